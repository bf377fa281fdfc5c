"""Multi-Scale Figure 2: the mirrored summation task, test MSE against the valid number K for
the paper's MS-Trans variants, the Transformer and a BiLSTM.

    python -m scripts.mirrored_summation                          # K = 10, 30, 50, 70, 90
    python -m scripts.mirrored_summation --ks 10 50 --steps 100   # a quick look

The task (paper, "Hierarchical Multi-Scale or Flexible Multi-Scale"): a sequence of N vectors
a_1..a_N in R^d drawn from U(0, 1); the target is sum_{i=1..K} a_i * a_{N-i+1} (element-wise
product), so the shortest dependency path is N - K. N = 100, d = 50 (Figure 2). The paper
trains on 200k and tests on 200k random samples; here every training batch is drawn afresh
(``--steps`` x ``--batch`` samples, seeded) and the test set is ``--test-samples`` samples of
another seed; nothing is downloaded.

Models (paper): MS-Trans-Hier-S, 2 layers of 10 heads of scale 3; MS-Trans-deepHier-S, 6 such
layers; MS-Trans-Flex, 2 layers of 10 heads with scales 3, N/16, N/8, N/4, N/2, two heads each.
The paper does not size the Transformer or the BiLSTM, nor the hidden size: ours are 2 layers of
10 full-sentence heads (fairseq's ``transformer`` encoder layers) and a 2-layer BiLSTM, all at
hidden size ``--dim`` (100). Each reads the vectors through a linear layer (scaled and with
sinusoidal positions, as fairseq's encoders embed tokens), mean-pools its top layer and maps it
linearly to R^d, scaled and shifted by the target's standard deviation and mean (estimated
once from 1,000 samples of a third seed, so that every K starts at the target's variance);
Adam, MSE loss. The MS-Trans layers are the plugin's (``ms_transformer``'s
encoder with ``--encoder-scales``), with their feed-forward blocks. Writes
``benchmarks/mirrored_summation.{json,md,png}``: MSE of the target as defined (which grows
with K) and MSE over the target's test variance (scale-free).
"""

import argparse
import json
from pathlib import Path
from typing import Dict, List

import torch
from torch import nn

from fairseq_plugins.command_line import import_extra
from fairseq_plugins.recipes.measure_flops import build_model, synthetic_dictionary
from scripts.benchmark_graph_attention import machine_line

REPO = Path(__file__).resolve().parents[1]
COMMAND = "python -m scripts.mirrored_summation"
LENGTH, INPUT_DIM, HEADS = 100, 50, 10  # paper: Figure 2 (n, d) and the three settings (10 heads)
ENCODERS = {  # name -> (arch, options)
    "MS-Trans-Hier-S": ("ms_transformer", {"encoder-layers": 2, "encoder-scales": ",".join(["3"] * HEADS)}),
    "MS-Trans-deepHier-S": ("ms_transformer", {"encoder-layers": 6, "encoder-scales": ",".join(["3"] * HEADS)}),
    "MS-Trans-Flex": ("ms_transformer", {"encoder-layers": 2,
                                         "encoder-scales": "3,3,N/16,N/16,N/8,N/8,N/4,N/4,N/2,N/2"}),
    "Transformer": ("transformer", {"encoder-layers": 2}),
}
MODELS = (*ENCODERS, "BiLSTM")


def mirrored_summation(samples: int, length: int, dim: int, k: int, generator: torch.Generator):
    """``samples`` sequences [samples, length, dim] from U(0, 1) and their targets
    sum_{i=1..k} a_i * a_{length-i+1} [samples, dim]."""
    if not 1 <= k <= length:
        raise ValueError(f"K must be in 1..{length} (the sequence length), got {k}")
    a = torch.rand(samples, length, dim, generator=generator)
    return a, (a[:, :k] * a.flip(1)[:, :k]).sum(dim=1)


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


def train_and_test(name: str, k: int, args) -> Dict[str, float]:
    _, sample = mirrored_summation(1000, args.length, INPUT_DIM, k, torch.Generator().manual_seed(args.seed + 2))
    torch.manual_seed(args.seed)
    model = Regressor(name, args.dim, sample.mean().item(), sample.std().item())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_gen = torch.Generator().manual_seed(args.seed)
    model.train()
    for _ in range(args.steps):
        a, target = mirrored_summation(args.batch, args.length, INPUT_DIM, k, train_gen)
        loss = nn.functional.mse_loss(model(a), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    a, target = mirrored_summation(args.test_samples, args.length, INPUT_DIM, k,
                                   torch.Generator().manual_seed(args.seed + 1))
    model.eval()
    with torch.no_grad():
        mse = nn.functional.mse_loss(model(a), target).item()
    return {"model": name, "k": k, "test_mse": mse, "relative_mse": mse / target.var().item()}


def write_outputs(out: Path, setup: str, rows: List[dict]) -> None:
    lines = ["# Multi-Scale Figure 2: mirrored summation\n", f"{setup}.\n",
             "| K | model | test MSE | MSE / Var(target) |", "|---|---|---|---|"]
    lines += [f"| {r['k']} | {r['model']} | {r['test_mse']:.4f} | {r['relative_mse']:.3f} |" for r in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=1) + "\n", encoding="utf-8")

    matplotlib = import_extra("matplotlib", "plots", "the benchmark's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["model"] for r in rows):
        sel = [r for r in rows if r["model"] == name]
        for ax, key in zip(axes, ("test_mse", "relative_mse")):
            ax.plot([r["k"] for r in sel], [r[key] for r in sel], marker="o", label=name)
    for ax, title in zip(axes, ("test MSE", "test MSE / Var(target)")):
        ax.set_xlabel("K")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(setup, fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.md')}, .json and .png")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ks", type=int, nargs="+", default=[10, 30, 50, 70, 90], help="valid numbers K")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--length", type=int, default=LENGTH, help="sequence length N (paper: 100)")
    p.add_argument("--dim", type=int, default=100, help="hidden size of every model (a multiple of 10)")
    p.add_argument("--steps", type=int, default=300, help="training updates")
    p.add_argument("--batch", type=int, default=64, help="training sequences per update")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--test-samples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "mirrored_summation")
    args = p.parse_args(argv)
    if args.dim % HEADS or args.dim < HEADS:
        p.error(f"--dim must be a positive multiple of {HEADS} (the heads)")
    if min(args.steps, args.batch, args.test_samples) < 1:
        p.error("--steps, --batch and --test-samples must be at least 1")
    bad = [k for k in args.ks if not 1 <= k <= args.length]
    if bad:
        p.error(f"--ks must lie in 1..--length ({args.length}), got {bad}")
    rows = []
    for k in args.ks:
        for name in args.models:
            rows.append(train_and_test(name, k, args))
            print(f"K {k} {name}: test MSE {rows[-1]['test_mse']:.4f} "
                  f"({rows[-1]['relative_mse']:.3f} of the target's variance)", flush=True)
    setup = (f"{machine_line(COMMAND).rstrip('.')}; N {args.length}, d {INPUT_DIM}, hidden {args.dim}, "
             f"{args.steps} updates of {args.batch}, Adam lr {args.lr}, {args.test_samples} test samples, "
             f"seed {args.seed}")
    write_outputs(args.out, setup, rows)
    return rows


if __name__ == "__main__":
    main()
