"""SegTree Figure 2: peak memory of one training step against sequence length, SegTree-Transformer
(``segtree_lm``) and the Transformer of the same size (``transformer_lm_matched``), measured in
the same run.

    python -m scripts.benchmark_segtree_memory                          # the paper's two settings
    python -m scripts.benchmark_segtree_memory --settings 1 --lengths 64 128 256 512

The settings, the step and its peak are ``fairseq_plugins.recipes.figures.segtree_memory``'s
(also the rows of ``fairseq-plugins-reproduce segtree-figure2``); the lengths are powers of two
here (``--lengths``: the paper does not list its figure's). The Markdown, JSON and PNG go to
``benchmarks/``; ratios are against the Transformer at the same length and setting.
"""

import argparse
import json
from pathlib import Path
from typing import List

import torch

from fairseq_plugins.command_line import import_extra
from fairseq_plugins.recipes.figures.segtree_memory import MODELS, SETTINGS, allocator, compare
from scripts.benchmark_graph_attention import machine_line

REPO = Path(__file__).resolve().parents[1]
COMMAND = "python -m scripts.benchmark_segtree_memory"


def write_outputs(out: Path, device: torch.device, rows: List[dict]) -> None:
    setup = f"{machine_line(COMMAND).rstrip('.')}; device {device}; {allocator(device)}"
    lines = [f"# SegTree Figure 2: peak memory of one training step ({device.type.upper()})\n",
             f"{setup}.\n",
             "Forward, cross-entropy and backward, fp32, dropout 0, after a warm-up step; the peak is what the step "
             "allocates beyond the parameters (gradients included). Settings: SegTree Appendix A.3 Table 4.\n",
             "| setting | n | model | step peak MiB | / Transformer | parameters MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['length']} | {r['model']} | {r['peak_step_bytes'] / 2**20:.1f} | "
                     f"{r['ratio']:.3f} | {r['parameter_bytes'] / 2**20:.1f} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"setup": setup, "settings": SETTINGS, "rows": rows}, indent=1)
                                        + "\n", encoding="utf-8")

    matplotlib = import_extra("matplotlib", "plots", "the benchmark's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({r["setting"] for r in rows})
    fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 4), squeeze=False)
    for ax, setting_id in zip(axes[0], settings):
        for name in MODELS:
            sel = [r for r in rows if r["setting"] == setting_id and r["model"] == name]
            ax.plot([r["length"] for r in sel], [r["peak_step_bytes"] / 2**20 for r in sel], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(f"peak {device.type.upper()} memory of a step (MiB)")
        ax.set_title(f"Setting {setting_id}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"SegTree Figure 2 ({device.type.upper()}): memory vs. sequence length", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.md')}, .json and .png")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", type=int, nargs="+", choices=sorted(SETTINGS), default=sorted(SETTINGS),
                   help="the paper's settings to measure (Appendix A.3 Table 4)")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048],
                   help="sequence lengths (the paper's figure does not list them)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None,
                   help="output prefix (default benchmarks/segtree_memory_<device type>)")
    args = p.parse_args(argv)
    if min(args.lengths) < 2:
        p.error("--lengths must be at least 2")
    device = torch.device(args.device)
    rows = [row for s in args.settings for n in args.lengths for row in compare(s, n, device)]
    write_outputs(args.out or REPO / "benchmarks" / f"segtree_memory_{device.type}", device, rows)
    return rows


if __name__ == "__main__":
    main()
