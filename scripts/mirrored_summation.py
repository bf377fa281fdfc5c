"""Multi-Scale Figure 2: the mirrored summation task, test MSE against the valid number K for
the paper's MS-Trans variants, the Transformer and a BiLSTM.

    python -m scripts.mirrored_summation                          # K = 10, 30, 50, 70, 90
    python -m scripts.mirrored_summation --ks 10 50 --steps 100   # a quick look

The task, the models and their training are ``fairseq_plugins.recipes.figures.mirrored_summation``'s
(also the rows of ``fairseq-plugins-reproduce ms-figure2``): N = 100 vectors of d = 50, every
training batch drawn afresh (``--steps`` x ``--batch`` samples, seeded), the test set
``--test-samples`` samples of another seed, every model at hidden size ``--dim`` (100). Writes
``benchmarks/mirrored_summation.{json,md,png}``: MSE of the target as defined (which grows
with K) and MSE over the target's test variance (scale-free).
"""

import argparse
import json
from pathlib import Path
from typing import List

from fairseq_plugins.command_line import import_extra
from fairseq_plugins.recipes.figures.mirrored_summation import INPUT_DIM, LENGTH, MODELS, problems, train_and_test
from scripts.benchmark_graph_attention import machine_line

REPO = Path(__file__).resolve().parents[1]
COMMAND = "python -m scripts.mirrored_summation"


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
    found = problems(args.ks, args.length, args.dim, args.steps, args.batch, args.test_samples)
    if found:
        p.error("; ".join(found))
    rows = []
    for k in args.ks:
        for name in args.models:
            rows.append(train_and_test(name, k, args.length, args.dim, args.steps, args.batch, args.lr,
                                       args.test_samples, args.seed))
            print(f"K {k} {name}: test MSE {rows[-1]['test_mse']:.4f} "
                  f"({rows[-1]['relative_mse']:.3f} of the target's variance)", flush=True)
    setup = (f"{machine_line(COMMAND).rstrip('.')}; N {args.length}, d {INPUT_DIM}, hidden {args.dim}, "
             f"{args.steps} updates of {args.batch}, Adam lr {args.lr}, {args.test_samples} test samples, "
             f"seed {args.seed}")
    write_outputs(args.out, setup, rows)
    return rows


if __name__ == "__main__":
    main()
