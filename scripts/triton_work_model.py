#!/usr/bin/env python
"""Work model of the triton graph-attention kernels vs dense flash attention vs FlexAttention.

No GPU here, so the speed argument is a model, and every time it prints is an ESTIMATE. For
the BPT paper's setting (6 layers, d 512, 8 heads of 64, 8192 tokens per batch, n 512-16384,
k 1/4/16/64, bf16), per layer forward + backward:

* triton: the kernels' actual launch plan (``tile_plan``): tensor-core tile FLOPs (forward
  2 products per tile, dQ 3, dK/dV 4) and HBM bytes (see ``triton_work``); also in fp32,
  with the fp32 plan's tiles, 4-byte elements and three tf32 products per product (tf32x3);
* dense: FlashAttention-2 over the n tokens (128 x 128 tiles; forward 2, backward 5 products);
* flex: FlexAttention's block mask from the same graph (128 x 128 blocks over ~2n nodes).

H100 SXM roofline: time = max(FLOPs / 989 TFLOP/s, bytes / 3.35 TB/s) for dense and flex
(bf16); for triton also the wave bound of its launch (programs over 132 SMs x resident
blocks, the blocks per SM from the compiled registers and shared memory of ``triton_aot``,
sm_90a); fp32 at 495 / 3 TFLOP/s (tf32x3).

    python scripts/triton_work_model.py                  # full grid, writes benchmarks/triton_work_model.{md,png}
    python scripts/triton_work_model.py --lengths 512 --ks 1 4 --out /tmp/wm   # tiny
"""

import argparse
import math
import sys
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_plugins.graph_attention import triton_aot  # noqa: E402
from fairseq_plugins.graph_attention.flex_backend import graph_blocks  # noqa: E402
import torch  # noqa: E402

from fairseq_plugins.graph_attention.triton_backend import tiles  # noqa: E402
from fairseq_plugins.graph_attention.tile_plan import build_plan  # noqa: E402
from fairseq_plugins.graphs.binary_partition import bpt_graph  # noqa: E402

PEAK_FLOPS = 989e12  # H100 SXM dense bf16 tensor cores
# fp32: tf32x3, three tf32 products at 494.7 TFLOP/s
TRITON_PEAK_FLOPS = {torch.bfloat16: PEAK_FLOPS, torch.float32: 494.7e12 / 3}
HBM_BYTES_PER_S = 3.35e12
SMS = 132
ELEMENT = 2  # bf16 bytes
FLASH_BLOCK = 128


def triton_work(graph, dim: int, dtype=torch.bfloat16):
    """(tile FLOPs per head, HBM bytes per head, HBM bytes per layer shared by all heads,
    programs per head, longest program in tiles), with the plan's tiles for ``dtype``.

    Bytes count each distinct byte once per kernel: K/V rows per tile (Q/dO rows per
    window), the rows of each query block, the relative-key table [N, T] (fp32, its rows
    reread from L1/L2 by the gathers) and its gradient; the int16 type tiles are the same for
    every sentence and head (a few MB, kept in the 50 MB L2): counted once per layer."""
    block_m, block_n = tiles(dtype, dim)
    element = dtype.itemsize
    plan = build_plan(graph, block_m, block_n)
    tile = 2 * block_m * block_n * dim  # FLOPs of one product of a tile
    flops = (2 + 3) * plan.num_tiles * tile + 4 * plan.num_windows * tile
    rows = 2 * block_n * dim * element  # K and V rows of a tile, or Q and dO rows of a window
    blocks = plan.slot_node.numel() // block_m
    table = graph.num_nodes * graph.num_edge_types * 4
    per_head = (2 * plan.num_tiles * rows + plan.num_windows * (rows + 8 * block_n)
                + blocks * block_m * (dim * element * 5 + 12)  # Q, O, Q, dO, dQ; lse, delta
                + graph.num_nodes * dim * element * 4  # K, V of the key side; dK, dV
                + 5 * table)  # the table read by 3 kernels, its gradient written and read
    shared = (2 * plan.num_tiles + plan.num_windows) * block_m * block_n * 2
    programs = plan.query_work.items.size(0) * 2 + plan.key_work.items.size(0)
    longest = max(int((plan.query_work.items[:, 2] - plan.query_work.items[:, 1]).max()),
                  int((plan.key_work.items[:, 2] - plan.key_work.items[:, 1]).max()))
    return flops, per_head, shared, programs, longest


def dense_work(n: int, dim: int):
    """FlashAttention-2 over n tokens: 7 products of n^2 d, K/V re-read per query block."""
    flops = 7 * 2 * n * n * dim
    blocks = -(-n // FLASH_BLOCK)
    num_bytes = 3 * blocks * 2 * n * dim * ELEMENT + 8 * n * dim * ELEMENT
    return flops, num_bytes


def flex_work(graph, dim: int):
    """FlexAttention over the graph's non-empty 128 x 128 blocks (forward 2, backward 5)."""
    blocks = int(graph_blocks(graph, "cpu").kv_num_blocks.sum())
    tile = 2 * FLASH_BLOCK * FLASH_BLOCK * dim
    num_bytes = 3 * blocks * 2 * FLASH_BLOCK * dim * ELEMENT + 8 * graph.num_nodes * dim * ELEMENT
    return 7 * blocks * tile, num_bytes, blocks


def occupancy(head_dim: int):
    """{dtype: {kernel: compile report}} of the triton kernels at ``head_dim`` on sm_90a, with
    dropout (training), compiled."""
    jobs = [(c, 90) for c in triton_aot.launched_configurations()
            if c.head_dim == head_dim and c.dropout and c.dtype in ("bfloat16", "float32")]
    reports = {torch.bfloat16: {}, torch.float32: {}}
    for r in triton_aot.compile_all(jobs):
        reports[getattr(torch, r.configuration.dtype)][r.configuration.kernel] = r
    return reports


def triton_time(graph, head_dim, heads, layers, dtype, compiled) -> float:
    """Roofline ESTIMATE (s) of the triton kernels, forward + backward, over all layers."""
    flops, per_head, shared, programs, longest = triton_work(graph, head_dim, dtype)
    resident = min(r.blocks_per_sm for r in compiled[dtype].values())
    peak = TRITON_PEAK_FLOPS[dtype]
    block_m, block_n = tiles(dtype, head_dim)
    waves = math.ceil(programs * heads / layers / (SMS * resident)) * layers
    tile_time = 2 * block_m * block_n * head_dim * 4 / (peak / SMS / resident)
    return max(roofline(flops * heads, per_head * heads + shared * layers, peak),
               waves * longest * tile_time)


def roofline(flops, num_bytes, peak=PEAK_FLOPS):
    return max(flops / peak, num_bytes / HBM_BYTES_PER_S)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "triton_work_model")
    args = parser.parse_args(argv)
    head_dim = args.dim // args.heads
    compiled = occupancy(head_dim)
    rows = []
    for n, k in tqdm([(n, k) for n in args.lengths for k in args.ks], desc="graphs"):
        graph = bpt_graph(n, k)
        heads = max(1, args.tokens // n) * args.heads * args.layers  # (sentence, head) pairs
        t_flops, t_bytes = triton_work(graph, head_dim)[:2]
        d_flops, d_bytes = dense_work(n, head_dim)
        f_flops, f_bytes, f_blocks = flex_work(graph, head_dim)
        times = {dtype: triton_time(graph, head_dim, heads, args.layers, dtype, compiled)
                 for dtype in compiled}
        rows.append(dict(n=n, k=k, triton_tiles=t_flops // (2 * 64 * 64 * head_dim * 7),
                         dense_tiles=d_flops // (2 * 64 * 64 * head_dim * 7),
                         flex_tiles=f_blocks * 4,
                         flops_vs_dense=d_flops / t_flops, flops_vs_flex=f_flops / t_flops,
                         triton_bytes=t_bytes, bytes_per_nlogn=t_bytes / (n * math.log2(n)),
                         flex_bytes=f_bytes, dense_bytes=d_bytes,
                         dense_ms=roofline(d_flops * heads, d_bytes * heads) * 1e3,
                         flex_ms=roofline(f_flops * heads, f_bytes * heads) * 1e3,
                         triton_ms=times[torch.bfloat16] * 1e3,
                         triton_fp32_ms=times[torch.float32] * 1e3))
    write(rows, compiled, args)


def write(rows, compiled, args):
    lines = [
        "# Work model: triton graph attention vs dense flash attention vs FlexAttention",
        "",
        f"BPT graphs, {args.layers} layers, d {args.dim}, {args.heads} heads, {args.tokens} "
        "tokens per batch, bf16, forward + backward. Tiles: 64 x 64 x 64-equivalents per "
        "head (FLOPs / 7 products). Times: H100 SXM roofline ESTIMATES (989 TFLOP/s, "
        "3.35 TB/s; triton also bounded by its waves at the compiled occupancy), not "
        "measurements. The last column: the triton kernels on fp32 inputs (the fp32 plan's "
        "tiles, 4-byte elements, tf32x3 products at 495 / 3 TFLOP/s).",
        "",
        *(f"Compiled occupancy (sm_90a, {str(dtype)[6:]}, head dim {args.dim // args.heads}, "
          "dropout): " + ", ".join(
              f"{name} {r.registers} registers, {r.shared / 1024:.0f} KiB shared, "
              f"{r.blocks_per_sm} blocks/SM" for name, r in reports.items()) + "."
          for dtype, reports in compiled.items()),
        "",
        "| n | k | triton tiles | flex tiles | dense tiles | FLOPs dense/triton | FLOPs flex/triton "
        "| MB per head triton / flex / dense | triton bytes / (n log2 n) | est. dense ms "
        "| est. flex ms | est. triton ms | est. triton fp32 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['k']} | {r['triton_tiles']} | {r['flex_tiles']} | "
            f"{r['dense_tiles']} | {r['flops_vs_dense']:.1f}x | {r['flops_vs_flex']:.1f}x | "
            f"{r['triton_bytes'] / 1e6:.1f} / {r['flex_bytes'] / 1e6:.1f} / "
            f"{r['dense_bytes'] / 1e6:.1f} | {r['bytes_per_nlogn']:.0f} | {r['dense_ms']:.2f} | "
            f"{r['flex_ms']:.2f} | {r['triton_ms']:.2f} | {r['triton_fp32_ms']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print("\n".join(lines))


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.5))
    lengths = sorted({r["n"] for r in rows})
    dense = {r["n"]: r["dense_ms"] for r in rows}
    axis.plot(lengths, [dense[n] for n in lengths], "k-o", label="dense flash (estimate)")
    for k in sorted({r["k"] for r in rows}):
        mine = [r for r in rows if r["k"] == k]
        axis.plot([r["n"] for r in mine], [r["triton_ms"] for r in mine], "-s",
                  label=f"triton k={k} (estimate)")
        axis.plot([r["n"] for r in mine], [r["flex_ms"] for r in mine], "--^",
                  label=f"flex k={k} (estimate)")
    axis.set(xscale="log", yscale="log", xlabel="sequence length n",
             ylabel="forward+backward ms, 6 layers (H100 roofline ESTIMATE)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
