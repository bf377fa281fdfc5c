"""Multi-Scale Figure 2: the mirrored summation task, test MSE against the valid number K for
the paper's MS-Trans variants, the Transformer and a BiLSTM.

The task (paper, "Hierarchical Multi-Scale or Flexible Multi-Scale"): a sequence of N vectors
a_1..a_N in R^d drawn from U(0, 1); the target is sum_{i=1..K} a_i * a_{N-i+1} (element-wise
product), so the shortest dependency path is N - K. N = 100, d = 50 (Figure 2). The paper
trains on 200k and tests on 200k random samples; here every training batch is drawn afresh
(``steps`` x ``batch`` samples, seeded) and the test set is ``test_samples`` samples of
another seed; nothing is downloaded.

Models (paper): MS-Trans-Hier-S, 2 layers of 10 heads of scale 3; MS-Trans-deepHier-S, 6 such
layers; MS-Trans-Flex, 2 layers of 10 heads with scales 3, N/16, N/8, N/4, N/2, two heads each.
The paper does not size the Transformer or the BiLSTM, nor the hidden size: ours are 2 layers of
10 full-sentence heads (fairseq's ``transformer`` encoder layers) and a 2-layer BiLSTM, all at
hidden size ``dim``. Each reads the vectors through a linear layer (scaled and with
sinusoidal positions, as fairseq's encoders embed tokens), mean-pools its top layer and maps it
linearly to R^d, scaled and shifted by the target's standard deviation and mean (estimated
once from 1,000 samples of a third seed, so that every K starts at the target's variance);
Adam, MSE loss. The MS-Trans layers are the plugin's (``ms_transformer``'s encoder with
``--encoder-scales``), with their feed-forward blocks.

A row of a ``measure: mirrored-summation`` table sets ``evaluate: {model, k, length, dim, steps,
batch, lr, test-samples, seed}``.
"""

from typing import Dict, Iterator, List, Tuple

import torch
from torch import nn

from ..config import ConfigError
from ..measure_flops import build_model, synthetic_dictionary
from . import row_settings

LENGTH, INPUT_DIM, HEADS = 100, 50, 10  # paper: Figure 2 (n, d) and the three settings (10 heads)
ENCODERS = {  # name -> (arch, options)
    "MS-Trans-Hier-S": ("ms_transformer", {"encoder-layers": 2, "encoder-scales": ",".join(["3"] * HEADS)}),
    "MS-Trans-deepHier-S": ("ms_transformer", {"encoder-layers": 6, "encoder-scales": ",".join(["3"] * HEADS)}),
    "MS-Trans-Flex": ("ms_transformer", {"encoder-layers": 2,
                                         "encoder-scales": "3,3,N/16,N/16,N/8,N/8,N/4,N/4,N/2,N/2"}),
    "Transformer": ("transformer", {"encoder-layers": 2}),
}
MODELS = (*ENCODERS, "BiLSTM")
KEYS = {"model": str, "k": int, "length": int, "dim": int, "steps": int, "batch": int, "lr": float,
        "test-samples": int, "seed": int}  # a table row's evaluate section


def mirrored_summation(samples: int, length: int, dim: int, k: int, generator: torch.Generator):
    """``samples`` sequences [samples, length, dim] from U(0, 1) and their targets
    sum_{i=1..k} a_i * a_{length-i+1} [samples, dim]."""
    if not 1 <= k <= length:
        raise ValueError(f"K must be in 1..{length} (the sequence length), got {k}")
    a = torch.rand(samples, length, dim, generator=generator)
    return a, (a[:, :k] * a.flip(1)[:, :k]).sum(dim=1)


def problems(ks: List[int], length: int, dim: int, steps: int, batch: int, test_samples: int) -> List[str]:
    """What is wrong with these settings, one sentence each (none: they can run)."""
    found = []
    if dim % HEADS or dim < HEADS:
        found.append(f"the hidden size must be a positive multiple of {HEADS} (the heads), got {dim}")
    if min(steps, batch, test_samples) < 1:
        found.append("the updates, the batch and the test samples must be at least 1")
    bad = [k for k in ks if not 1 <= k <= length]
    if bad:
        found.append(f"K must lie in 1..N ({length}), got {bad}")
    return found


class Regressor(nn.Module):
    """Vectors in, one vector out: input projection, an encoder, mean-pooling, a linear map."""

    def __init__(self, name: str, dim: int, target_mean: float, target_std: float, input_dim: int = INPUT_DIM):
        super().__init__()
        self.name = name
        self.target_mean, self.target_std = target_mean, target_std
        self.inp = nn.Linear(input_dim, dim)
        if name == "BiLSTM":
            self.encoder = nn.LSTM(dim, dim // 2, num_layers=2, batch_first=True, bidirectional=True)
        else:
            arch, options = ENCODERS[name]
            opts = {"encoder-embed-dim": dim, "encoder-ffn-embed-dim": 2 * dim, "encoder-attention-heads": HEADS,
                    "decoder-embed-dim": dim, "decoder-ffn-embed-dim": 2 * dim, "decoder-attention-heads": HEADS,
                    "decoder-layers": 1, "dropout": 0.0, **options}
            # the encoder of the registered model: its decoder is not used
            self.encoder = build_model({"arch": arch, "model": opts}, synthetic_dictionary(8, 1)).encoder
        self.out = nn.Linear(dim, input_dim)

    def forward(self, a):
        x = self.inp(a)
        if self.name == "BiLSTM":
            h = self.encoder(x)[0]
        else:
            tokens = torch.full(a.shape[:2], 4, dtype=torch.long, device=a.device)  # no padding
            lengths = torch.full((a.size(0),), a.size(1), device=a.device)
            h = self.encoder(tokens, lengths, token_embeddings=x)["encoder_out"][0].transpose(0, 1)
        return self.out(h.mean(dim=1)) * self.target_std + self.target_mean


def train_and_test(model: str, k: int, length: int, dim: int, steps: int, batch: int, lr: float, test_samples: int,
                   seed: int, device: str = "cpu") -> Dict[str, float]:
    """Train the figure's model ``model`` at one K on fresh batches; its test MSE, also over the
    target's test variance."""
    _, sample = mirrored_summation(1000, length, INPUT_DIM, k, torch.Generator().manual_seed(seed + 2))
    torch.manual_seed(seed)
    name, model = model, Regressor(model, dim, sample.mean().item(), sample.std().item()).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    train_gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        a, target = mirrored_summation(batch, length, INPUT_DIM, k, train_gen)
        loss = nn.functional.mse_loss(model(a.to(device)), target.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    a, target = mirrored_summation(test_samples, length, INPUT_DIM, k, torch.Generator().manual_seed(seed + 1))
    model.eval()
    with torch.no_grad():
        mse = nn.functional.mse_loss(model(a.to(device)), target.to(device)).item()
    return {"model": name, "k": k, "test_mse": mse, "relative_mse": mse / target.var().item()}


def settings(cfg: Dict) -> Dict:
    s = row_settings(cfg, KEYS, {"model": MODELS})
    found = problems([s["k"]], s["length"], s["dim"], s["steps"], s["batch"], s["test_samples"])
    if found:
        raise ConfigError(f"{cfg['name']}: " + "; ".join(found))
    return s


def plan(s: Dict) -> str:
    return (f"mirrored summation, {s['model']} trained at K {s['k']} (N {s['length']}, d {INPUT_DIM}, hidden "
            f"{s['dim']}; {s['steps']} Adam updates of {s['batch']} fresh samples, lr {s['lr']}, seed {s['seed']}), "
            f"test MSE on {s['test_samples']} samples")


def measure(todo: List[Tuple[Dict, Dict]], device: torch.device) -> Iterator[Tuple[Dict, Dict]]:
    """(row, results JSON) of each row: the test MSE (the table's metric)."""
    for cfg, s in todo:
        result = train_and_test(**s, device=device)
        yield cfg, {"mse": result["test_mse"], **result, "device": str(device),
                    "measured_on": f"{plan(s)}; {result['relative_mse']:.3f} of the target's test variance"}
