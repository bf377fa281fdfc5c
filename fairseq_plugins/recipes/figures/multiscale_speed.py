"""Multi-Scale Figure 4: test time per batch of 128 sentences, Multi-Scale Transformer against
the Transformer (and a BiLSTM), at the sentence lengths of IMDB, MR and the MTL-16 average.

Models, as the MTL-16 rows of ``configs/multiscale/table3.yaml`` build them: ``ms_classifier``
(d 300, 10 heads, alpha 0.5, scales 1, 3, N/16, N/8, N/4, 3 layers without FFN) and
``transformer_classifier`` with 3 layers and 10 heads; the BiLSTM (the figure's third model,
which the paper does not size) is ours: one bidirectional layer of 150 units per direction
over the same 300-d embeddings, max-pooled. Every sentence of the batch has the dataset's
length (no padding). One test batch is the forward pass to the logits in eval mode without
gradients; the models of one length alternate, one warm-up pass each, then the median of
``repeats``.

Lengths: the MTL-16 average, 109 tokens, is the paper's (Sec. Text Classification); the paper
states that the largest speed-up is at an average of 201 tokens, read here as IMDB, the
figure's longest dataset; MR's 21 tokens is ours: the paper gives no MR length and the MTL-16
release (Liu, Qiu and Huang 2017) is not available offline here, so 21 stands for one sentence
(MR's reviews are single sentences).

A row of a ``measure: test-time`` table sets ``evaluate: {model, dataset, length, batch,
repeats}``; the rows of one length, batch and repeats are timed together, alternating.
"""

import statistics
import time
from typing import Callable, Dict, Iterator, List, Tuple

import torch
from torch import nn

from ..config import ConfigError
from ..measure_flops import build_model as build_row_model
from ..measure_flops import synthetic_dictionary
from . import row_settings

BATCH = 128  # paper: Figure 4
DATASETS = {"IMDB": 201, "MR": 21, "AVG": 109}  # tokens per sentence (see the module docstring)
DICTIONARY_SIZE = 10000  # ours: the embedding table's size does not change the time of a pass
BASELINE = "Transformer"
CLASSIFIERS = {  # name -> (arch, model options), the MTL-16 rows of configs/multiscale/table3.yaml
    "MS-Trans": ("ms_classifier", {}),
    "Transformer": ("transformer_classifier", {"encoder-layers": 3, "encoder-attention-heads": 10}),
}
MODELS = (*CLASSIFIERS, "BiLSTM")
KEYS = {"model": str, "dataset": str, "length": int, "batch": int, "repeats": int}  # a row's evaluate section


class BiLSTMClassifier(nn.Module):
    """Embeddings, one bidirectional LSTM layer, max-pooling over time, a linear classifier."""

    def __init__(self, vocab: int, dim: int = 300, classes: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim // 2, batch_first=True, bidirectional=True)
        self.out = nn.Linear(dim, classes)

    def forward(self, tokens, lengths=None):
        return self.out(self.lstm(self.embed(tokens))[0].max(dim=1).values)


def build_model(name: str, device: torch.device) -> Callable:
    """The figure's model ``name`` as a function of (tokens, lengths) giving the logits."""
    dictionary = synthetic_dictionary(DICTIONARY_SIZE, 3)
    torch.manual_seed(0)
    if name == "BiLSTM":
        return BiLSTMClassifier(len(dictionary)).to(device).eval()
    arch, options = CLASSIFIERS[name]
    model = build_row_model({"arch": arch, "model": options}, dictionary)
    model.register_classification_head("head", num_classes=2)
    model.to(device).eval()
    return lambda tokens, lengths, m=model: m(tokens, lengths, classification_head_name="head")[0]


def build_models(device: torch.device, names=MODELS) -> Dict[str, Callable]:
    """name -> a function of (tokens, lengths) giving the logits."""
    return {name: build_model(name, device) for name in names}


def test_batch_seconds(models: Dict[str, Callable], length: int, repeats: int, device: torch.device,
                       batch: int = BATCH) -> Dict[str, float]:
    """Median seconds of one test batch per model, the models alternating."""
    gen = torch.Generator().manual_seed(length)
    tokens = torch.randint(4, DICTIONARY_SIZE, (batch, length), generator=gen).to(device)
    lengths = torch.full((batch,), length, device=device)
    times = {name: [] for name in models}
    with torch.no_grad():
        for repeat in range(repeats + 1):
            for name, model in models.items():
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                model(tokens, lengths)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if repeat:  # the first pass is a warm-up
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def settings(cfg: Dict) -> Dict:
    s = row_settings(cfg, KEYS, {"model": MODELS})
    if min(s["length"], s["batch"], s["repeats"]) < 1:
        raise ConfigError(f"{cfg['name']}: evaluate.length, batch and repeats must be at least 1")
    return s


def plan(s: Dict) -> str:
    return (f"test time of {s['model']}, forward to the logits without gradients, a batch of {s['batch']} "
            f"sentences of {s['length']} tokens ({s['dataset']}), median of {s['repeats']}")


def measure(todo: List[Tuple[Dict, Dict]], device: torch.device) -> Iterator[Tuple[Dict, Dict]]:
    """(row, results JSON) of each row: ms per batch (the table's metric); the rows of one length
    are timed in one loop, and beside the Transformer's time where it is one of them."""
    groups: Dict[Tuple[int, int, int], List[Tuple[Dict, Dict]]] = {}
    for cfg, s in todo:
        groups.setdefault((s["length"], s["batch"], s["repeats"]), []).append((cfg, s))
    for (length, batch, repeats), rows in groups.items():
        seconds = test_batch_seconds(build_models(device, [s["model"] for _, s in rows]), length, repeats, device,
                                     batch)
        for cfg, s in rows:
            ratio = f"; {seconds[s['model']] / seconds[BASELINE]:.2f} x the Transformer's" if BASELINE in seconds \
                else ""
            yield cfg, {"ms": 1000 * seconds[s["model"]], "seconds": seconds[s["model"]], **s, "device": str(device),
                        "measured_on": f"{plan(s)}; {device.type.upper()}, fp32, timed alternating with "
                                       f"{', '.join(m for m in seconds if m != s['model']) or 'no other model'}"
                                       f"{ratio}"}
