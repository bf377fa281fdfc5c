"""Multi-scale window attention against dense attention, measured in the same run.

    python -m scripts.benchmark_multiscale_attention                  # n = 256 ... 4096
    python -m scripts.benchmark_multiscale_attention --lengths 256 512 --repeats 2

For every length n, times forward + backward (median over ``--repeats``, the variants
interleaved so that load on a shared machine hits all alike) of:

* ``dense``: full attention, ``F.scaled_dot_product_attention`` (fused kernel) -- the baseline;
* ``masked``: the dense masked reference (``multiscale_attention_reference``), i.e. what an
  n x n window mask costs;
* ``window`` variants: ``multiscale_attention`` with constant windows ``1,3,5,...``
  (the paper's sequence-labelling candidates) and with the paper's alpha=0.5 bottom-layer
  mix over ``1,3,N/16,N/8,N/4``.

Memory is the activation memory autograd keeps for backward (bytes of the distinct tensors
saved by the graph, via ``torch.autograd.graph.saved_tensors_hooks``), which is what grows
with n; on CUDA the peak allocation is reported as well.  Writes a Markdown table, a JSON
file and a PNG plot to ``benchmarks/``; ratios are against ``dense`` from the same run.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fairseq_plugins.command_line import import_extra
from fairseq_plugins.modules.multiscale.multiscale_attention import (
    multiscale_attention,
    multiscale_attention_reference,
    parse_scales,
)
from fairseq_plugins.modules.multiscale.scale_distribution import PAPER_CANDIDATES, alpha_head_counts, expand_counts

REPO = Path(__file__).resolve().parents[1]


def variants(heads: int):
    paper_counts = alpha_head_counts(0.5, heads, 2, 5)[0]
    constant = ",".join(str(2 * (h % 5) + 1) for h in range(heads))
    paper = expand_counts(paper_counts, parse_scales(PAPER_CANDIDATES))
    return {
        "dense": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        "masked": lambda q, k, v: multiscale_attention_reference(q, k, v, paper)[0],
        f"window {constant}": lambda q, k, v: multiscale_attention(q, k, v, parse_scales(constant)),
        "window " + ",".join(map(str, paper)): lambda q, k, v: multiscale_attention(q, k, v, paper),
    }


def saved_bytes(fn, q, k, v) -> int:
    """Bytes of the distinct tensors autograd saves for backward while running ``fn``."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(q, k, v)
    del out
    return sum(storages.values())


def step(fn, q, k, v) -> float:
    for x in (q, k, v):
        x.grad = None
    if q.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(q, k, v).square().mean().backward()
    if q.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def peak_cuda_bytes(fn, q, k, v) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(fn, q, k, v)
    return torch.cuda.max_memory_allocated() - base


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--masked-max-length", type=int, default=2048,
                        help="skip the dense masked reference above this length (its n x n memory)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "multiscale_attention")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = torch.device(args.device)
    fns = variants(args.heads)
    rows = []
    for n in args.lengths:
        q, k, v = (torch.randn(args.batch, args.heads, n, args.head_dim, device=device, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        active = {name: fn for name, fn in fns.items() if name != "masked" or n <= args.masked_max_length}
        times = {name: [] for name in active}
        for fn in active.values():  # warm-up
            step(fn, q, k, v)
        for r in range(args.repeats):
            for name, fn in active.items():
                times[name].append(step(fn, q, k, v))
            print(f"n={n}: repeat {r + 1}/{args.repeats}", flush=True)
        for name, fn in active.items():
            row = {"n": n, "variant": name, "seconds": statistics.median(times[name]),
                   "saved_bytes": saved_bytes(fn, q, k, v)}  # fmt: skip
            if device.type == "cuda":
                row["peak_cuda_bytes"] = peak_cuda_bytes(fn, q, k, v)
            rows.append(row)
        dense = next(r for r in rows if r["n"] == n and r["variant"] == "dense")
        for row in rows:
            if row["n"] == n:
                row["time_ratio"] = row["seconds"] / dense["seconds"]
                row["memory_ratio"] = row["saved_bytes"] / dense["saved_bytes"]
                print(f"  {row['variant']:<45} {row['seconds']:8.4f} s  x{row['time_ratio']:.2f} time  "
                      f"{row['saved_bytes'] / 2**20:9.1f} MiB  x{row['memory_ratio']:.2f} memory",
                      flush=True)  # fmt: skip
    write_outputs(args, device, rows)


def write_outputs(args, device, rows):
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = (f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, batch {args.batch}, "
             f"{args.heads} heads x {args.head_dim}, fp32, forward + backward, median of {args.repeats}")  # fmt: skip
    cuda = device.type == "cuda"
    lines = ["# Multi-scale window attention vs dense attention\n", f"{setup}.\n",
             "Memory: activations saved for backward" + (" / peak CUDA allocation" if cuda else "") + ".\n",
             "| n | variant | time (s) | time / dense | saved MiB | memory / dense |"
             + (" peak CUDA MiB |" if cuda else ""),
             "|---|---|---|---|---|---|" + ("---|" if cuda else "")]  # fmt: skip
    for row in rows:
        line = (f"| {row['n']} | {row['variant']} | {row['seconds']:.4f} | {row['time_ratio']:.2f} | "
                f"{row['saved_bytes'] / 2**20:.1f} | {row['memory_ratio']:.3f} |")  # fmt: skip
        if cuda:
            line += f" {row['peak_cuda_bytes'] / 2**20:.1f} |"
        lines.append(line)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    args.out.with_suffix(".json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=1), encoding="utf-8")

    matplotlib = import_extra("matplotlib", "plots", "the benchmark's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(row["variant"] for row in rows):
        sel = [row for row in rows if row["variant"] == name]
        label = name if len(name) < 40 else name[:37] + "..."
        ax_time.plot([r["n"] for r in sel], [r["seconds"] for r in sel], marker="o", label=label)
        ax_mem.plot([r["n"] for r in sel], [r["saved_bytes"] / 2**20 for r in sel], marker="o", label=label)
    for ax, title in ((ax_time, "forward + backward time (s)"), (ax_mem, "activation memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=7)
    fig.suptitle(setup, fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out.with_suffix('.md')}, .json and .png")


if __name__ == "__main__":
    main()
