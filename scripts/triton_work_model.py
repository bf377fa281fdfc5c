#!/usr/bin/env python
"""ESTIMATE of one graph-attention op (forward + backward) on an H100: the triton kernels and
their glue against dense FlashAttention (SDPA) and FlexAttention, until ``check_gpu`` measures.

No GPU here, so every time this prints is an estimate, built from the assumptions in
``ASSUMPTIONS`` (printed with the tables, with a low and a high value where they are
uncertain) and from what can be counted without a GPU:

* the compiled kernels: the binaries the backend launches for bf16 at this head dim,
  compiled for sm_90a by the installed Triton (``triton_aot``): per tile, the instructions a
  thread issues in the tile loop (from the SASS, by class), the control bits' fixed stall
  cycles, the tensor-core FLOPs, and the registers and shared memory that set the blocks
  per SM. Three ceilings per tile: issue (an SM issues 4 warp instructions a cycle), stalls
  (one warp waits at least its fixed stalls; the resident blocks overlap) and the tensor
  cores; the kernel runs at the slowest of them over its tiles, or at HBM speed, or at its
  longest program;
* the tiles of each kernel, from the plan the backend launches (``tile_plan.build_plan``);
* the glue: every PyTorch op the backend runs around its kernels in one forward + backward,
  with the bytes it touches and the host syncs, and the bytes of every kernel's tensor
  arguments, counted by running the backend under Triton's interpreter on a small graph
  with split blocks (a ``TorchDispatchMode`` that pauses while a kernel runs), scaled to
  the op's size; the merge kernels of split blocks and the relative-key kernels (the table,
  d rel_key) are costed on the GPU like a glue op;
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

if __name__ == "__main__":  # not in the compiling processes triton_aot spawns, which import this file too
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the glue count runs the kernels

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_plugins.graph_attention import graph_attention, tile_plan, triton_aot, triton_backend  # noqa: E402
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present  # noqa: E402
from fairseq_plugins.modules.common.heads import split_heads  # noqa: E402

Range = Tuple[float, float]
# name: (value or (low, high), unit, why). Every estimate below is built from these.
ASSUMPTIONS: Dict[str, Tuple[object, str, str]] = {
    "sms": (132, "", "H100 SXM5 streaming multiprocessors"),
    "clock": ((1.6e9, 1.98e9), "Hz", "SM clock: 1.98 GHz is the H100 SXM5 boost clock; under sustained load it is "
              "assumed to stay above 1.6 GHz"),
    "issue_width": (4, "warp instructions / cycle / SM", "4 warp schedulers per SM, one instruction each a cycle"),
    "static_issue": (True, "", "every instruction of the tile loop's body issues once per tile (the tile kernels' "
                     "loop bodies are predicated straight-line code; a predicated-off instruction still issues)"),
    "issue_efficiency": ((0.5, 0.9), "of the slowest ceiling", "what a kernel reaches of its issue, stall or "
                         "tensor-core ceiling: the control bits' stalls leave out the variable waits (global and "
                         "shared loads, MUFU, the asynchronous wgmma), which the resident warps hide only in part"),
    "tensor_flop_per_cycle": (4096, "FLOP / cycle / SM", "dense bf16 tensor cores of an H100 SXM: 989.4 TFLOP/s = "
                              "132 SMs x 4096 x 1.83 GHz"),
    "hbm": (3.35e12 * 0.8, "B/s", "H100 SXM HBM3 3.35 TB/s, of which 80% is reached by streaming kernels"),
    "l2_reuse": (True, "", "every tensor argument of a kernel launch (K/V rows, type tiles, tables) is moved through "
                 "HBM once per launch: the grid runs the blocks of one (sentence, head) together (heads on grid.y), "
                 "whose K/V (2 MB at n 8192) stay in the 50 MB L2 while they are reread"),
    "balance": (True, "", "the tiles spread evenly over the SMs, except the longest program (its tiles on one SM "
                "after all others finished: the tail)"),
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
TILE_KERNELS = ("forward", "backward_query", "backward_key")


def value(name):
    return ASSUMPTIONS[name][0]


def rate_at(name: str, n: int) -> Tuple[float, float]:
    """(forward, backward) FLOP/s of a measured dense kernel at the nearest measured length."""
    table = value(name)
    nearest = min(table, key=lambda length: abs(math.log2(length / n)))
    return tuple(1e12 * r for r in table[nearest])


# ------------------------------------------------------------------------ counted work

def plan_work(graph, dim: int, dtype=torch.bfloat16) -> Dict[str, object]:
    """Per (sentence, head), from the plan the backend launches: the tiles each tile kernel
    walks (forward and dQ: the query blocks' tiles; dK/dV: the key blocks' windows), the
    longest program of each, the tiles' fill, the edge types a forward tile holds (the dQ
    kernel's loop over them runs once per type)."""
    block_m, block_n = triton_backend.tiles(dtype, dim)
    plan = tile_plan.build_plan(graph, block_m, block_n)
    types_per_tile = plan.tile_type_ids.numel() / max(plan.num_tiles, 1)
    longest = [int((work.items[:, 2] - work.items[:, 1]).max()) if work.items.numel() else 0
               for work in (plan.query_work, plan.key_work)]
    return {"block_m": block_m, "block_n": block_n,
            "tiles": {"forward": plan.num_tiles, "backward_query": plan.num_tiles, "backward_key": plan.num_windows},
            "longest": {"forward": longest[0], "backward_query": longest[0], "backward_key": longest[1]},
            "fill": graph.num_edges / (plan.num_tiles * block_m * block_n),
            "inner": {"forward": 1.0, "backward_query": types_per_tile, "backward_key": 1.0}}


def compiled_kernels(dim: int, dtype: str = "bfloat16", capability: int = 90) -> Dict[str, triton_aot.CompileReport]:
    """The tile kernels the backend launches for ``dtype`` and ``dim`` on ``capability``,
    without dropout, compiled by the installed Triton (``triton_aot``): their resources and
    the instruction mix of their tile loops. Where a kernel has several launched variants,
    the one with the longest tile loop (the estimate stays an upper bound for it)."""
    launched = [c for c in triton_aot.launched_configurations(capability)
                if c.kernel in TILE_KERNELS and c.dtype == dtype and c.head_dim == dim and not c.dropout]
    reports = triton_aot.compile_all([(c, capability) for c in launched])
    heaviest = {}
    for r in reports:
        if r.loop is None:
            raise RuntimeError(f"no tile loop found in the SASS of {r.configuration}")
        if r.configuration.kernel not in heaviest or r.loop["total"] > heaviest[r.configuration.kernel].loop["total"]:
            heaviest[r.configuration.kernel] = r
    return heaviest


def tile_cycles(report: triton_aot.CompileReport, inner: float = 1.0) -> Dict[str, float]:
    """Cycles of one SM per tile of a kernel, by ceiling: issue (each of the block's warps
    issues the loop body: warps x instructions over the SM's issue width), stalls (a warp
    waits at least the fixed stalls per tile; the resident blocks overlap theirs) and the
    tensor cores (the block's FLOPs per tile at the SM's rate); and the cycles one block
    alone needs per tile (its warps each on their own scheduler), for the tail. A loop
    nested in the tile loop (the dQ kernel's over a tile's edge types) runs ``inner`` times
    a tile (the SASS counts it once)."""
    warps, loop = report.configuration.num_warps, report.loop
    total = loop["total"] + (inner - 1) * loop.get("nested", 0)
    stalls = loop["stall_cycles"] + (inner - 1) * loop.get("nested_stall_cycles", 0)
    return {"issue": warps * total / value("issue_width"),
            "stalls": stalls / report.blocks_per_sm,
            "tensor": warps * loop["tensor_flops"] / value("tensor_flop_per_cycle"),
            "alone": max(total, stalls), "instructions": total}


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
        self.kernels = []  # (kernel, bytes of its tensor arguments) of each tile kernel launched

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
        else:
            counter.kernels.append((self.fn.__name__, sum(a.numel() * a.element_size() for a in args
                                                          if isinstance(a, torch.Tensor))))
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
    merge kernels among the Triton launches (``merges``, ``merge_bytes``) and for the
    tensor arguments of each tile kernel (``kernel_bytes``, by the kernel function's name)."""
    graph = bpt_graph(tokens, 1)
    one, two = (_glue_of_one_op(graph, tokens, dim, heads) for heads in (1, 2))
    return {"tokens": tokens, "ops": len(one.ops), "syncs": one.syncs, "launches": one.launches,
            "bytes": _per_node(one.ops, two.ops, graph.num_nodes),
            "names": sorted({name for name, _ in one.ops}),
            "merges": [name for name, _ in one.merges],
            "merge_bytes": _per_node(one.merges, two.merges, graph.num_nodes),
            "kernel_bytes": dict(zip([name for name, _ in one.kernels],
                                     _per_node(one.kernels, two.kernels, graph.num_nodes)))}


# ------------------------------------------------------------------------ the estimate

def kernel_estimate(name: str, report, work, pairs: int, nodes: int, glue) -> Dict[str, object]:
    """One tile kernel's GPU time (low, high) and the ceiling that sets it."""
    cycles = tile_cycles(report, work["inner"][name])
    tiles = work["tiles"][name] * pairs
    per_graph, per_pair = glue["kernel_bytes"][report.configuration.kernel + "_kernel"]
    memory = nodes * (per_graph + pairs * per_pair) / value("hbm")
    bound = max(("issue", "stalls", "tensor"), key=cycles.get)
    times, limits = [], []
    for clock, efficiency in zip(reversed(value("clock")), reversed(value("issue_efficiency"))):  # fast first
        parts = {f"SM {bound}": tiles * cycles[bound] / (value("sms") * clock) / efficiency,
                 "tail": work["longest"][name] * cycles["alone"] / clock / efficiency, "HBM": memory}
        limits.append(max(parts, key=parts.get))
        times.append(parts[limits[-1]])
    limit = " / ".join(dict.fromkeys(limits))
    return {"time": tuple(times), "tiles": tiles, "cycles": cycles, "memory": memory, "limit": limit}


def triton_estimate(graph, n: int, args, glue, kernels) -> Dict[str, object]:
    pairs = max(1, args.tokens // n) * args.heads
    work = plan_work(graph, args.head_dim)
    per_kernel = {name: kernel_estimate(name, kernels[name], work, pairs, graph.num_nodes, glue)
                  for name in TILE_KERNELS}
    kernel_time = tuple(sum(k["time"][i] for k in per_kernel.values()) for i in (0, 1))
    small_kernels = [glue["kernel_bytes"][name + "_kernel"] for name in triton_backend.REL_KERNELS]
    glue_bytes = [graph.num_nodes * (per_graph + pairs * per_pair)
                  for per_graph, per_pair in glue["bytes"] + glue["merge_bytes"] + small_kernels]
    glue_gpu = [sum(max(b / value("hbm"), floor) for b in glue_bytes) for floor in value("min_kernel_s")]
    host = [glue["ops"] * a + glue["launches"] * t + p for a, t, p in
            zip(value("aten_launch_s"), value("triton_launch_s"), value("python_s"))]
    gpu = [k + g for k, g in zip(kernel_time, glue_gpu)]
    flops = sum(kernels[name].loop["tensor_flops"] * kernels[name].configuration.num_warps * per_kernel[name]["tiles"]
                for name in TILE_KERNELS)
    return {"kernels": kernel_time, "per_kernel": per_kernel, "glue_gpu": tuple(glue_gpu), "host": tuple(host),
            "total": (max(gpu[0], host[0]), gpu[1] + host[1]), "work": work, "tflop": flops / 1e12}


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


def _ratio(dense: Range, ours: Range) -> str:
    return f"{dense[0] / ours[1]:.1f}-{dense[1] / ours[0]:.1f}x"


def write(rows, glue, kernels, args) -> str:
    import triton

    lines = [
        "# Work model of one graph-attention op: ESTIMATES, not measurements",
        "",
        f"Per op: one attention of {args.heads} heads x {args.head_dim}, {args.tokens} tokens per batch "
        "(batch = tokens / n sentences), bf16, forward + backward, on an H100 SXM. Every time is an ESTIMATE "
        "from the assumptions below and the counts from the compiled kernels, written as low-high; "
        "`python -m fairseq_plugins.check_gpu` replaces them with measurements. Generated by "
        "`python scripts/triton_work_model.py`.",
        "",
        "## Assumptions", "", "| name | value | unit | why |", "|---|---|---|---|",
    ]
    for name, (val, unit, why) in ASSUMPTIONS.items():
        shown = "measured table" if isinstance(val, dict) else val
        lines.append(f"| {name} | {shown} | {unit} | {why} |")
    headline = next((r for r in rows if (r["n"], r["k"]) == (8192, 4)), rows[0])
    inner = headline["triton"]["work"]["inner"]
    lines += [
        "", "## The compiled kernels (counted)", "",
        f"The binaries launched for bf16, head dim {args.head_dim}, without dropout, compiled for sm_90a by Triton "
        f"{triton.__version__} (`triton_aot`). Loop: the instructions one thread issues per tile (the tile loop of "
        "the SASS, by class; a loop nested in it, the dQ kernel's over the tile's edge types, counted once, its "
        f"instructions in the nested column); per tile at n {headline['n']}, k {headline['k']} the nested loop runs "
        f"{inner['backward_query']:.2f} times (the edge types a tile holds, on average): per tile = loop + (times - "
        "1) x nested. Stalls: the control bits' fixed stall cycles over the loop; cycles per tile on one SM: issue "
        "= warps x per tile / issue width, stalls = stall cycles / blocks per SM, tensor = the block's tensor-core "
        "FLOPs / FLOP per cycle.", "",
        "| kernel | tile | warps | stages | registers | shared KiB | blocks/SM | warps/scheduler | loop | nested "
        "| per tile | tensor core | floating point | integer and address | predicate | memory | conversion | uniform "
        "| sync and control | stalls | cycles/tile: issue | stalls | tensor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in TILE_KERNELS:
        r = kernels[name]
        c, loop, cycles = r.configuration, r.loop, tile_cycles(r, inner[name])
        lines.append(
            f"| {name} | {c.block_m} x {c.block_n} | {c.num_warps} | {c.num_stages} | {r.registers} | "
            f"{r.shared / 1024:.1f} | {r.blocks_per_sm} | {r.blocks_per_sm * c.num_warps / value('issue_width'):g} | "
            f"{loop['total']} | {loop['nested']} | {cycles['instructions']:.0f} | " + " | ".join(str(loop[k]) for k in (
                "tensor core", "floating point", "integer and address", "predicate", "memory", "conversion",
                "uniform", "sync and control", "stall_cycles"))
            + f" | {cycles['issue']:.0f} | {cycles['stalls']:.0f} | {cycles['tensor']:.0f} |")
    host = [glue["ops"] * a for a in value("aten_launch_s")], [glue["launches"] * t for t in value("triton_launch_s")]
    lines += [
        "",
        "## Glue and host launches (counted)", "",
        f"One forward + backward run under Triton's interpreter on BPT k = 1 over {glue['tokens']} tokens (bf16, "
        f"relative keys, padding, split blocks): {glue['ops']} PyTorch ops that launch kernels "
        f"({', '.join(glue['names'])}), {glue['launches']} Triton kernel launches ({len(glue['merges'])} of them "
        f"the merges of split blocks{': ' + ', '.join(glue['merges']) if glue['merges'] else ''}, and "
        f"{len(triton_backend.REL_KERNELS)} the relative-key kernels: {', '.join(triton_backend.REL_KERNELS)}; "
        f"both costed on the GPU like glue ops) and {glue['syncs']} host syncs; run with 1 and 2 heads, so that "
        "each op's bytes, and "
        "each kernel's tensor arguments, split into a part per (sentence, head) and node and a part per node, "
        "scaled to the op. Host time of one op, listed: "
        f"{glue['ops']} PyTorch ops x {value('aten_launch_s')[0] * 1e6:g}-{value('aten_launch_s')[1] * 1e6:g} us "
        f"= {ms(host[0])} ms, {glue['launches']} Triton launches x "
        f"{value('triton_launch_s')[0] * 1e6:g}-{value('triton_launch_s')[1] * 1e6:g} us = {ms(host[1])} ms, "
        f"the op's Python {ms(value('python_s'))} ms.",
    ]
    t = headline["triton"]
    lines += [
        "", f"## ESTIMATE at n {headline['n']}, k {headline['k']} (batch {headline['batch']})", "",
        "| kernel | tiles (all heads) | longest program (tiles) | HBM ms | estimate ms | set by |",
        "|---|---|---|---|---|---|",
    ]
    for name in TILE_KERNELS:
        k = t["per_kernel"][name]
        lines.append(f"| {name} | {k['tiles']} | {t['work']['longest'][name]} | {k['memory'] * 1e3:.3f} | "
                     f"{ms(k['time'])} | {k['limit']} |")
    lines += [
        "", "| | estimate ms | this op is faster by |", "|---|---|---|",
        f"| triton kernels | {ms(t['kernels'])} | |",
        f"| glue on the GPU ({glue['ops']} ops, {len(glue['merges'])} merge and {len(triton_backend.REL_KERNELS)} "
        f"relative-key kernels) | {ms(t['glue_gpu'])} | |",
        f"| host ({glue['ops']} ops, {glue['launches']} Triton launches, Python) | {ms(t['host'])} | |",
        f"| **triton op** (max(GPU, host) .. GPU + host) | **{ms(t['total'])}** | |",
    ]
    for name, label in (("fa2", "FlashAttention-2 (SDPA)"), ("fa3", "FlashAttention-3"), ("cudnn", "cuDNN"),
                        ("flex", f"FlexAttention ({headline['flex_blocks']} blocks per head)")):
        lines.append(f"| {label} | {ms(headline[name])} | {_ratio(headline[name], t['total'])} |")
    lines += [
        "", "## Per op, every n and k", "",
        "| n | k | batch | tiles / head | tile fill | flex blocks / head | flex fill | triton TFLOP | "
        "kernels ms | glue GPU ms | host ms | **triton op ms** | FA2 ms | FA3 ms | cuDNN ms | flex ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["triton"]
        lines.append(
            f"| {r['n']} | {r['k']} | {r['batch']} | {t['work']['tiles']['forward']} | {t['work']['fill']:.1%} | "
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
    kernels = compiled_kernels(args.head_dim)
    glue = count_glue(args.glue_tokens, args.head_dim)
    rows = []
    for n in args.lengths:
        for k in args.ks:
            graph = bpt_graph(n, k)
            flex, blocks = flex_estimate(graph, n, args)
            block = value("flex_block")
            rows.append({"n": n, "k": k, "batch": max(1, args.tokens // n),
                         "triton": triton_estimate(graph, n, args, glue, kernels), "flex": flex, "flex_blocks": blocks,
                         "flex_fill": graph.num_edges / (blocks * block * block),
                         **{name: dense_estimate(n, args, f"{name}_rate") for name in ("fa2", "fa3", "cudnn")}})
            print(f"n {n} k {k} done", file=sys.stderr)
    print(write(rows, glue, kernels, args))


if __name__ == "__main__":
    main()
