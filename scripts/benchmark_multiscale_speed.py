"""Multi-Scale Figure 4: test time per batch of 128 sentences, Multi-Scale Transformer against
the Transformer (and a BiLSTM), at the sentence lengths of IMDB, MR and the MTL-16 average,
measured in the same run.

    python -m scripts.benchmark_multiscale_speed
    python -m scripts.benchmark_multiscale_speed --repeats 3 --lengths AVG=109

Models, as the MTL-16 rows of ``configs/multiscale/table3.yaml`` build them: ``ms_classifier``
(d 300, 10 heads, alpha 0.5, scales 1, 3, N/16, N/8, N/4, 3 layers without FFN) and
``transformer_classifier`` with 3 layers and 10 heads; the BiLSTM (the figure's third model,
which the paper does not size) is ours: one bidirectional layer of 150 units per direction
over the same 300-d embeddings, max-pooled. Every sentence of the batch has the dataset's
length (no padding). One test batch is the forward pass to the logits in eval mode without
gradients; the models alternate, one warm-up pass each, then the median of ``--repeats``.

Lengths: the MTL-16 average, 109 tokens, is the paper's (Sec. Text Classification); the paper
states that the largest speed-up is at an average of 201 tokens, which this script reads as
IMDB, the figure's longest dataset; MR's 21 tokens is ours: the paper gives no MR length and
the MTL-16 release (Liu, Qiu and Huang 2017) is not available offline here, so 21 stands for one
sentence (MR's reviews are single sentences). ``--lengths NAME=N`` replaces them. Ratios are
against the Transformer of the same run.
"""

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torch import nn

from fairseq_plugins.command_line import import_extra
from fairseq_plugins.recipes.measure_flops import build_model, synthetic_dictionary
from scripts.benchmark_graph_attention import machine_line

REPO = Path(__file__).resolve().parents[1]
COMMAND = "python -m scripts.benchmark_multiscale_speed"
BATCH = 128  # paper: Figure 4
DATASETS = {"IMDB": 201, "MR": 21, "AVG": 109}  # tokens per sentence (see the module docstring)
DICTIONARY_SIZE = 10000  # ours: the embedding table's size does not change the time of a pass
BASELINE = "Transformer"
CLASSIFIERS = {  # name -> (arch, model options), the MTL-16 rows of configs/multiscale/table3.yaml
    "MS-Trans": ("ms_classifier", {}),
    "Transformer": ("transformer_classifier", {"encoder-layers": 3, "encoder-attention-heads": 10}),
}


class BiLSTMClassifier(nn.Module):
    """Embeddings, one bidirectional LSTM layer, max-pooling over time, a linear classifier."""

    def __init__(self, vocab: int, dim: int = 300, classes: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim // 2, batch_first=True, bidirectional=True)
        self.out = nn.Linear(dim, classes)

    def forward(self, tokens, lengths=None):
        return self.out(self.lstm(self.embed(tokens))[0].max(dim=1).values)


def build_models(device: torch.device) -> Dict[str, Callable]:
    """name -> a function of (tokens, lengths) giving the logits."""
    dictionary = synthetic_dictionary(DICTIONARY_SIZE, 3)
    models = {}
    for name, (arch, options) in CLASSIFIERS.items():
        torch.manual_seed(0)
        model = build_model({"arch": arch, "model": options}, dictionary)
        model.register_classification_head("head", num_classes=2)
        model.to(device).eval()
        models[name] = lambda tokens, lengths, m=model: m(tokens, lengths, classification_head_name="head")[0]
    torch.manual_seed(0)
    models["BiLSTM"] = BiLSTMClassifier(len(dictionary)).to(device).eval()
    return models


def test_batch_seconds(models: Dict[str, Callable], length: int, repeats: int,
                       device: torch.device) -> Dict[str, float]:
    """Median seconds of one test batch per model, the models alternating."""
    gen = torch.Generator().manual_seed(length)
    tokens = torch.randint(4, DICTIONARY_SIZE, (BATCH, length), generator=gen).to(device)
    lengths = torch.full((BATCH,), length, device=device)
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


def write_outputs(out: Path, setup: str, rows: List[dict]) -> None:
    lines = [f"# Multi-Scale Figure 4: test time per batch of {BATCH}\n", f"{setup}.\n",
             "| dataset | tokens | model | ms per batch | / Transformer |", "|---|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['length']} | {r['model']} | {1000 * r['seconds']:.1f} | {r['ratio']:.2f} |"
              for r in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"setup": setup, "batch": BATCH, "rows": rows}, indent=1) + "\n",
                                        encoding="utf-8")

    matplotlib = import_extra("matplotlib", "plots", "the benchmark's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(models)
    for i, name in enumerate(models):
        ms = [1000 * next(r["seconds"] for r in rows if r["dataset"] == d and r["model"] == name) for d in datasets]
        ax.bar([j + i * width for j in range(len(datasets))], ms, width, label=name)
    ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(datasets))])
    ax.set_xticklabels([f"{d} ({next(r['length'] for r in rows if r['dataset'] == d)})" for d in datasets])
    ax.set_ylabel(f"ms per test batch of {BATCH}")
    ax.set_title("Multi-Scale Figure 4 (" + setup.split("; ")[1] + ")", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.md')}, .json and .png")


def parse_length(text: str):
    name, _, value = text.partition("=")
    if not name or not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=TOKENS with TOKENS >= 1, got {text!r}")
    return name, int(value)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=parse_length, nargs="+", default=list(DATASETS.items()),
                   help="NAME=TOKENS per dataset (default: IMDB=201 MR=21 AVG=109)")
    p.add_argument("--repeats", type=int, default=5, help="timed batches per model and length (median)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None,
                   help="output prefix (default benchmarks/multiscale_speed_<device type>)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    device = torch.device(args.device)
    models = build_models(device)
    rows = []
    for dataset, length in args.lengths:
        seconds = test_batch_seconds(models, length, args.repeats, device)
        for name, s in seconds.items():
            rows.append({"dataset": dataset, "length": length, "model": name, "seconds": s,
                         "ratio": s / seconds[BASELINE]})
            print(f"{dataset} ({length} tokens) {name}: {1000 * s:.1f} ms per batch, "
                  f"{s / seconds[BASELINE]:.2f} x the Transformer", flush=True)
    setup = f"{machine_line(COMMAND).rstrip('.')}; device {device.type.upper()}; fp32, median of {args.repeats}"
    write_outputs(args.out or REPO / "benchmarks" / f"multiscale_speed_{device.type}", setup, rows)
    return rows


if __name__ == "__main__":
    main()
