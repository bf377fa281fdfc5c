#!/usr/bin/env python
"""ESTIMATE of one graph-attention op (forward + backward) on an H100: the triton kernels and
their glue against dense FlashAttention (SDPA) and FlexAttention, until ``check_gpu`` measures.

No GPU here, so every time this prints is an estimate, each built from the assumptions in
``ASSUMPTIONS`` (printed with the table, with a low and a high value where they are
uncertain) and from what can be counted without a GPU:

* the kernels' work, from their actual launch plan (``tile_plan.build_plan`` at the tiles
  ``triton_backend.tiles`` launches): tensor-core products per tile (forward 2, dQ 3,
  dK/dV 4) and the HBM bytes they must move once K/V and the type tiles are reused through
  L2;
* the glue: every PyTorch op the backend runs around its kernels in one forward + backward,
  counted with the bytes it touches and the host syncs, by running the backend under
  Triton's interpreter on a small graph with split blocks (a ``TorchDispatchMode`` that
  pauses while a kernel runs), scaled to the op's size; the merge kernels of split blocks
  are Triton launches, costed on the GPU like a glue op (their bytes, at least the shortest
  kernel time);
* dense attention: compute-bound at the rate FlashAttention's authors measured on an H100
  (FA2, FA3, cuDNN), for the FLOPs of the n tokens;
* FlexAttention: the graph's non-empty 128 x 128 blocks (all partial: no block of a BPT
  graph is full) at a fraction of FA2's rate.

    python scripts/triton_work_model.py                 # writes benchmarks/triton_work_model.md
    python scripts/triton_work_model.py --lengths 512 --ks 4 --glue-tokens 100 --out /tmp/wm
"""

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Dict, Tuple

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the glue count runs the kernels

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_plugins.graph_attention import graph_attention, tile_plan, triton_backend  # noqa: E402
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present  # noqa: E402
from fairseq_plugins.modules.common.heads import split_heads  # noqa: E402

Range = Tuple[float, float]
# name: (value or (low, high), unit, why). Every estimate below is built from these.
ASSUMPTIONS: Dict[str, Tuple[object, str, str]] = {
    "peak_bf16": (989e12, "FLOP/s", "H100 SXM dense bf16 tensor-core peak"),
    "hbm": (3.35e12 * 0.8, "B/s", "H100 SXM HBM3 3.35 TB/s, of which 80% is reached by streaming kernels"),
    "l2_reuse": (True, "", "K/V rows and type tiles are read from HBM once per kernel: the grid runs the "
                 "blocks of one (sentence, head) together (heads on grid.y), whose K/V (2 MB at n 8192) "
                 "stay in the 50 MB L2 while they are reread"),
    "tile_rate": ((150e12, 300e12), "FLOP/s", "the triton tile kernels: at most FA2's measured rate (the same "
                  "online-softmax tiles; Triton's own flash kernel measures 376-401 TFLOP/s forward at head "
                  "dim 64), at least half of it (64-row tiles, tile lists read indirectly, type gathers)"),
    "fa2_rate": ({512: (282, 198), 1024: (306, 238), 2048: (318, 264), 4096: (321, 279), 8192: (322, 287),
                  16384: (324, 291)}, "TFLOP/s (fwd, bwd)",
                 "FlashAttention-2, H100 SXM5, head dim 64, non-causal, bf16: FlashAttention-3 paper "
                 "(arXiv 2407.08608) figures; measured at 16k tokens x 2048 width per batch"),
    "fa3_rate": ({512: (333, 272), 1024: (392, 363), 2048: (460, 422), 4096: (476, 453), 8192: (496, 472),
                  16384: (497, 474)}, "TFLOP/s (fwd, bwd)", "FlashAttention-3, same figures"),
    "cudnn_rate": ({512: (335, 266), 1024: (373, 348), 2048: (395, 395), 4096: (408, 417), 8192: (412, 432),
                    16384: (413, 433)}, "TFLOP/s (fwd, bwd)", "cuDNN attention, same figures"),
    "dense_flops": ((4, 10), "x n^2 d per head (fwd, bwd)", "FlashAttention's count: backward = 2.5 forward"),
    "flex_fraction": ((0.4, 0.8), "of FA2's rate", "FlexAttention over partial blocks only (mask and "
                      "relative-key score_mod evaluated on every element; FlexAttention's paper reaches about "
                      "90% of FA2 on masks with full blocks)"),
    "flex_block": (128, "", "FlexAttention's block size (both sides)"),
    "min_kernel_s": ((2e-6, 3e-6), "s", "shortest GPU time of any kernel (launch latency on the GPU)"),
    "aten_launch_s": ((5e-6, 10e-6), "s", "host time of one eager PyTorch op that launches a kernel"),
    "triton_launch_s": ((15e-6, 40e-6), "s", "host time of one Triton kernel launch from Python"),
    "python_s": ((50e-6, 150e-6), "s", "host time of the op's own Python per forward + backward "
                 "(autograd.Function, plan cache lookup, argument checks)"),
    "overlap": ("max(GPU, host) .. GPU + host", "", "low: the host runs ahead of the GPU; high: a host sync "
                "inside the op (counted below) serializes them"),
    "dense_host_s": ((20e-6, 40e-6), "s", "host time of SDPA's forward + backward (2 kernels, little glue)"),
}


def value(name):
    return ASSUMPTIONS[name][0]


def rate_at(name: str, n: int) -> Tuple[float, float]:
    """(forward, backward) FLOP/s of a measured dense kernel at the nearest measured length."""
    table = value(name)
    nearest = min(table, key=lambda length: abs(math.log2(length / n)))
    return tuple(1e12 * r for r in table[nearest])


# ------------------------------------------------------------------------ counted work

def plan_work(graph, dim: int, dtype=torch.bfloat16) -> Dict[str, float]:
    """Per (sentence, head): tile FLOPs of the three kernels, the tiles' fill, the longest
    program; from the plan the backend launches."""
    block_m, block_n = triton_backend.tiles(dtype, dim)
    plan = tile_plan.build_plan(graph, block_m, block_n)
    tile = 2 * block_m * block_n * dim
    lengths = [work.items[:, 2] - work.items[:, 1] for work in (plan.query_work, plan.key_work)]
    return {"block_m": block_m, "block_n": block_n, "tiles": plan.num_tiles, "windows": plan.num_windows,
            "flops": (2 + 3) * plan.num_tiles * tile + 4 * plan.num_windows * tile,
            "fill": graph.num_edges / (plan.num_tiles * block_m * block_n),
            "longest_program_tiles": int(max(int(t.max()) for t in lengths if t.numel()))}


def flex_blocks(graph, block: int) -> int:
    """Non-empty block x block blocks of the adjacency (what FlexAttention's block mask keeps)."""
    rows, cols = graph.rows() // block, graph.indices // block
    return int(torch.unique(rows * (graph.num_nodes // block + 1) + cols).numel())


# the triton backend's torch.library ops -> their Python implementations
OP_IMPLEMENTATIONS = {"triton_graph_attention": triton_backend.attention_forward,
                      "triton_graph_attention_backward": triton_backend.attention_backward}


class GlueCount(TorchDispatchMode):
    """Every PyTorch op that launches a kernel, with the bytes it reads and writes, except
    while a Triton kernel runs (under the interpreter its arguments are copied around)."""

    NO_KERNEL = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "detach", "alias", "lift_fresh",
                 "_unsafe_view", "set_", "resize_"}

    def __init__(self):
        super().__init__()
        self.ops, self.syncs, self.launches, self.paused = [], 0, 0, 0
        self.merges = []  # (kernel, bytes) of each merge kernel launched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        implementation = OP_IMPLEMENTATIONS.get(name)
        if implementation is not None:  # the backend's torch.library ops: count their insides
            with self:
                return implementation(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        if name in ("_local_scalar_dense", "item", "is_nonzero"):
            self.syncs += 1
        elif not _aliases_its_input(func, args, out) and name not in self.NO_KERNEL:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.ops.append((name, sum(t.numel() * t.element_size() for t in tensors)))
        return out


def _aliases_its_input(func, args, out) -> bool:
    """A view: no kernel. Inside the ops (below autograd), composite ops such as ``to``,
    ``reshape`` and ``contiguous`` arrive whole, with a view's schema, and copy only
    sometimes: what counts is whether the output shares the input's memory."""
    if not func.is_view:
        return False
    if not (isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)):
        return True
    return out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()


def _glue_of_one_op(graph, tokens: int, dim: int, heads: int) -> GlueCount:
    from triton.runtime import interpreter

    batch = 2
    gen = torch.Generator().manual_seed(0)
    # q, k, v as fairseq's attention hands them over: [B, H, N, D] views of time-first
    # [N, B, H * D] projections
    projected = [torch.randn(graph.num_nodes, batch, heads * dim, generator=gen).bfloat16().requires_grad_()
                 for _ in range(3)]
    q, k, v = (split_heads(x, heads) for x in projected)
    rel = torch.randn(graph.num_edge_types, dim, generator=gen).bfloat16().requires_grad_()
    mask = ~node_present(torch.tensor([tokens, tokens // 2]), tokens)
    graph_attention(q, k, v, graph, rel, mask, backend="triton").sum().backward()  # plan cached
    for leaf in (*projected, rel):
        leaf.grad = None  # a training step's backward writes fresh gradients, not sums
    grad = torch.ones_like(q)  # in q's layout, as the backward of fairseq's merge of heads
    counter = GlueCount()
    run = interpreter.GridExecutor.__call__

    def kernel(self, *args, **kwargs):
        counter.paused += 1
        counter.launches += 1
        if self.fn.__name__.startswith("merge"):
            counter.merges.append((self.fn.__name__, _merge_bytes(dict(zip(self.arg_names, args)))))
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.paused -= 1

    interpreter.GridExecutor.__call__ = kernel
    try:
        with counter:
            out = graph_attention(q, k, v, graph, rel, mask, backend="triton")
            out.backward(grad)
    finally:
        interpreter.GridExecutor.__call__ = run
    return counter


def _merge_bytes(args: Dict[str, object]) -> int:
    """What a merge kernel moves: its fp32 part buffers, read once, and its split blocks'
    rows, written once in the target's dtype (``out_ptr``, ``grad_q_ptr`` or ``grad_k_ptr``
    and ``grad_v_ptr``)."""
    parts = [t for name, t in args.items() if name.startswith("part_") and name != "part_index_ptr"]
    targets = [t for name, t in args.items() if name in ("out_ptr", "grad_q_ptr", "grad_k_ptr", "grad_v_ptr")]
    rows = args["split_nodes_ptr"].numel() * parts[0].size(1)  # split rows x (sentence, head)
    return (sum(t.numel() * t.element_size() for t in parts)
            + sum(rows * t.size(-1) * t.element_size() for t in targets))


def _per_node(one, two, nodes: int):
    """[(bytes per node, bytes per node and (sentence, head))] of the same ops counted with 1
    and 2 heads (2 sentences)."""
    if [n for n, _ in one] != [n for n, _ in two]:
        raise RuntimeError("the glue differs between 1 and 2 heads: the per-head split does not apply")
    parts = []
    for (_, b1), (_, b2) in zip(one, two):
        per_pair = (b2 - b1) / 2  # 2 sentences: 2 more (sentence, head) pairs
        parts.append(((b1 - 2 * per_pair) / nodes, per_pair / nodes))
    return parts


def count_glue(tokens: int, dim: int) -> Dict[str, object]:
    """The backend's glue in one forward + backward (bf16, relative keys, padding) on BPT
    k = 1 over ``tokens`` (1100: its root row is split over two programs). Run with 1 and 2
    heads (2 sentences), so that each op's bytes split into a part per (sentence, head) and a
    part per graph: [(bytes per node, bytes per node and (sentence, head))]; the same for the
    merge kernels among the Triton launches (``merges``, ``merge_bytes``)."""
    graph = bpt_graph(tokens, 1)
    one, two = (_glue_of_one_op(graph, tokens, dim, heads) for heads in (1, 2))
    return {"tokens": tokens, "ops": len(one.ops), "syncs": one.syncs, "launches": one.launches,
            "bytes": _per_node(one.ops, two.ops, graph.num_nodes),
            "names": sorted({name for name, _ in one.ops}),
            "merges": [name for name, _ in one.merges],
            "merge_bytes": _per_node(one.merges, two.merges, graph.num_nodes)}


# ------------------------------------------------------------------------ the estimate

def triton_estimate(graph, n: int, args, glue) -> Dict[str, Range]:
    batch, heads, dim = max(1, args.tokens // n), args.heads, args.head_dim
    work = plan_work(graph, dim)
    pairs = batch * heads
    rows = pairs * graph.num_nodes * dim * 2  # one [B, H, N, D] bf16 tensor, bytes
    table = pairs * graph.num_nodes * graph.num_edge_types * 4  # the [N, T] fp32 relative-key scores
    # forward: Q K V in, O and lse out; dQ: Q K V O dO lse in, dQ and delta out; dK/dV: Q K V dO
    # lse/delta in, dK dV out (in the input dtype)
    kernel_bytes = 16 * rows + 4 * table + 2 * (2 * work["tiles"] + work["windows"]) * work["block_m"] * work["block_n"]
    memory = kernel_bytes / value("hbm")
    low_rate, high_rate = value("tile_rate")
    per_sm_tile = 4 * 2 * work["block_m"] * work["block_n"] * dim
    tail = [work["longest_program_tiles"] * per_sm_tile / (rate / 132) for rate in (high_rate, low_rate)]
    kernels = [max(work["flops"] * pairs / rate, memory, t) for rate, t in zip((high_rate, low_rate), tail)]
    glue_bytes = [graph.num_nodes * (per_graph + pairs * per_pair)
                  for per_graph, per_pair in glue["bytes"] + glue["merge_bytes"]]
    glue_gpu = [sum(max(b / value("hbm"), floor) for b in glue_bytes) for floor in value("min_kernel_s")]
    host = [glue["ops"] * a + glue["launches"] * t + p for a, t, p in
            zip(value("aten_launch_s"), value("triton_launch_s"), value("python_s"))]
    gpu = [k + g for k, g in zip(kernels, glue_gpu)]
    return {"kernels": tuple(kernels), "glue_gpu": tuple(glue_gpu), "host": tuple(host),
            "total": (max(gpu[0], host[0]), gpu[1] + host[1]), "work": work,
            "kernel_gb": kernel_bytes / 1e9, "tflop": work["flops"] * pairs / 1e12}


def dense_estimate(n: int, args, rates: str) -> Range:
    pairs = max(1, args.tokens // n) * args.heads
    fwd_flops, bwd_flops = (c * n * n * args.head_dim * pairs for c in value("dense_flops"))
    fwd, bwd = rate_at(rates, n)
    gpu = fwd_flops / fwd + bwd_flops / bwd
    low, high = value("dense_host_s")
    return (max(gpu, low), gpu + high)


def flex_estimate(graph, n: int, args) -> Tuple[Range, int]:
    pairs = max(1, args.tokens // n) * args.heads
    block = value("flex_block")
    blocks = flex_blocks(graph, block)
    fwd_flops, bwd_flops = (c * block * block * args.head_dim * blocks * pairs for c in value("dense_flops"))
    fwd, bwd = rate_at("fa2_rate", n)
    times = [fwd_flops / (f * fwd) + bwd_flops / (f * bwd) for f in reversed(value("flex_fraction"))]
    return tuple(times), blocks


def ms(r: Range) -> str:
    return f"{r[0] * 1e3:.2f}-{r[1] * 1e3:.2f}"


def write(rows, glue, args) -> str:
    lines = [
        "# Work model of one graph-attention op: ESTIMATES, not measurements",
        "",
        f"Per op: one attention of {args.heads} heads x {args.head_dim}, {args.tokens} tokens per batch "
        "(batch = tokens / n sentences), bf16, forward + backward, on an H100 SXM. Every time is an ESTIMATE "
        "from the assumptions below, written as low-high; `python -m fairseq_plugins.check_gpu` replaces "
        "them with measurements. Generated by `python scripts/triton_work_model.py`.",
        "",
        "## Assumptions", "", "| name | value | unit | why |", "|---|---|---|---|",
    ]
    for name, (val, unit, why) in ASSUMPTIONS.items():
        shown = "measured table" if isinstance(val, dict) else val
        lines.append(f"| {name} | {shown} | {unit} | {why} |")
    lines += [
        "",
        f"Counted, not assumed: the glue of one forward + backward, run under Triton's interpreter on BPT "
        f"k = 1 over {glue['tokens']} tokens (bf16, relative keys, padding, split blocks): "
        f"{glue['ops']} PyTorch ops that launch kernels ({', '.join(glue['names'])}), "
        f"{glue['launches']} Triton kernel launches ({len(glue['merges'])} of them the merges of split blocks"
        f"{': ' + ', '.join(glue['merges']) if glue['merges'] else ''}, costed on the GPU like glue ops) and "
        f"{glue['syncs']} host syncs; run with 1 and 2 heads, "
        "each op's bytes split into a part per (sentence, head) and node and a part per node, scaled to "
        "the op. Tile counts, fill and FLOPs come from the plan the backend launches; the FlexAttention "
        "blocks from the graph's adjacency.",
        "",
        "## Per op", "",
        "| n | k | batch | tiles / head | tile fill | flex blocks / head | flex fill | triton TFLOP | "
        "kernels ms | glue GPU ms | host ms | **triton op ms** | FA2 ms | FA3 ms | cuDNN ms | flex ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["triton"]
        lines.append(
            f"| {r['n']} | {r['k']} | {r['batch']} | {t['work']['tiles']} | {t['work']['fill']:.1%} | "
            f"{r['flex_blocks']} | {r['flex_fill']:.1%} | {t['tflop']:.3f} | {ms(t['kernels'])} | "
            f"{ms(t['glue_gpu'])} | {ms(t['host'])} | **{ms(t['total'])}** | {ms(r['fa2'])} | {ms(r['fa3'])} | "
            f"{ms(r['cudnn'])} | {ms(r['flex'])} |")
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--glue-tokens", type=int, default=1100,
                        help="tokens of the graph the glue is counted on (1100: with split blocks)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "triton_work_model")
    args = parser.parse_args(argv)
    glue = count_glue(args.glue_tokens, args.head_dim)
    rows = []
    for n in args.lengths:
        for k in args.ks:
            graph = bpt_graph(n, k)
            flex, blocks = flex_estimate(graph, n, args)
            block = value("flex_block")
            rows.append({"n": n, "k": k, "batch": max(1, args.tokens // n),
                         "triton": triton_estimate(graph, n, args, glue), "flex": flex, "flex_blocks": blocks,
                         "flex_fill": graph.num_edges / (blocks * block * block),
                         **{name: dense_estimate(n, args, f"{name}_rate") for name in ("fa2", "fa3", "cudnn")}})
            print(f"n {n} k {k} done", file=sys.stderr)
    print(write(rows, glue, args))


if __name__ == "__main__":
    main()
