"""The ``"cpu"`` backend of ``graph_attention``: a fused flash-style C++ kernel (``cpu_ext/``).

The torch tree path issues thousands of small ATen calls per step that run one after the
other; this kernel walks the same tiles as the Triton GPU kernels (``tile_plan``: query
blocks in tree order, each over a few tiles of consecutive keys) with one
``at::parallel_for`` over (batch x head, work item), register-blocked tile products on
pointers into q, k and v, an online softmax, and only the log-sum-exp saved for an FA2-style backward: no
[rows x keys] probabilities are stored, so memory grows like dense SDPA's at every k.

float32 and float64 (the tests compare float64 with the reference to ~1e-12); other dtypes
use the torch backend. The extension is built on first use or by
``scripts/build_cpu_ext.py`` into the per-user cache (``extension_build``); a failed build
warns once and leaves the torch backend in use.
"""

import hashlib
import platform
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from fairseq_plugins.graph_attention.extension_build import Extension
from fairseq_plugins.graph_attention.registry import register_backend
from fairseq_plugins.graph_attention.tile_plan import TilePlan, merge_forward, merge_sum, plan_on

SOURCE_DIR = Path(__file__).resolve().parents[2] / "cpu_ext" / "csrc"
DTYPES = (torch.float32, torch.float64)
# query rows x key columns of a tile (measured on 64-dim heads, see docs/design_notes.md)
BLOCK_M = 32
BLOCK_N = 32
# A work item walks at most this many tiles: only the long blocks (the root and the coarse
# spans read every token) are split, so that they spread over the threads; the GPU's 16 would
# split most blocks at k = 64 and the part buffers would cost as much memory as the output.
TILES_PER_ITEM = 128
# the build is for the CPU that builds it (the cache folder names the CPU's features): AVX2/AVX-512
# for the tile products and the softmax loops, which ``#pragma omp simd`` vectorizes
# (reductions in a fixed lane order); OpenMP, without which at::parallel_for (inline in
# torch's headers) runs serially; no errno from math functions, so that they vectorize
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")



def cpu_features() -> str:
    """A short fingerprint of this CPU's instruction set: the cache folder is per torch build
    *and* CPU, so that a home directory shared by different machines never runs a
    ``-march=native`` binary on a CPU that lacks its instructions (that would kill the
    process with SIGILL, past any fallback)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        flags = ""
    text = f"{platform.machine()} {platform.processor()} {flags}"
    return f"{platform.machine()}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"


EXTENSION = Extension(
    "fairseq_plugins_graph_attention_cpu", "cpu_ext", f"torch{torch.__version__}-{cpu_features()}",
    (SOURCE_DIR / "graph_attention_cpu.cpp",), cflags=CXX_FLAGS, ldflags=("-fopenmp",))


def load_extension(verbose: bool = False):
    """Build (first time, about a minute) or load the cached extension; raises on failure."""
    return EXTENSION.load(verbose)


def is_available(query: torch.Tensor) -> bool:
    """CPU tensors of float32/float64 once the extension builds (and loads)."""
    return query.device.type == "cpu" and query.dtype in DTYPES and EXTENSION.available()


def _plan_tensors(plan: TilePlan):
    return [plan.slot_node, plan.tile_start, plan.tile_types, plan.query_work.items,
            plan.window_start, plan.window_types, plan.key_work.items]


class CpuGraphAttention(torch.autograd.Function):
    """Forward and recomputing backward through the extension; split blocks merged here."""

    @staticmethod
    def forward(ctx, query, key, value, rel_key, key_padding_mask, plan: TilePlan, scale,
                dropout_p):
        bsz, heads, num_nodes, dim = query.shape
        q, k, v = (x.reshape(bsz * heads, num_nodes, dim).contiguous()
                   for x in (query, key, value))
        rel = None if rel_key is None else rel_key.to(q.dtype).contiguous()
        pad = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
        # the dropout seed comes from torch's generator: torch.manual_seed reproduces it
        seed = int(torch.randint(0, 2**62, ()).item()) if dropout_p > 0 else 0
        ext = load_extension()
        out, lse, part_out, part_lse = ext.forward(
            q, k, v, rel, pad, _plan_tensors(plan), plan.block_m, plan.block_n, heads,
            plan.query_work.num_parts, scale, dropout_p, seed)
        merge_forward(out, lse, part_out, part_lse, plan)
        ctx.save_for_backward(q, k, v, out, lse, rel_key, rel, pad)
        ctx.plan, ctx.heads = plan, heads
        ctx.scalars = (scale, dropout_p, seed)  # the backward's trailing kernel arguments
        return out.view(query.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, rel_key, rel, pad = ctx.saved_tensors
        plan, shape = ctx.plan, grad_out.shape
        grad_out = grad_out.reshape(q.shape).to(q.dtype).contiguous()
        delta = (grad_out * out).sum(-1)
        grad_q, grad_k, grad_v, grad_rel, part_q, part_k, part_v = load_extension().backward(
            grad_out, q, k, v, rel, pad, lse, delta, _plan_tensors(plan), plan.block_m,
            plan.block_n, ctx.heads, plan.query_work.num_parts, plan.key_work.num_parts,
            *ctx.scalars)
        merge_sum(grad_q, part_q, plan, plan.query_work, True)
        merge_sum(grad_k, part_k, plan, plan.key_work, False)
        merge_sum(grad_v, part_v, plan, plan.key_work, False)
        grad_rel = None if rel_key is None else grad_rel.to(rel_key.dtype)
        return (grad_q.view(shape), grad_k.view(shape), grad_v.view(shape), grad_rel, None,
                None, None, None)


def cpu_graph_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                        dropout_p=0.0, scale=None):
    """Backend function (see ``graph_attention`` for the semantics)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if query.dtype not in DTYPES or query.device.type != "cpu":
        raise ValueError(f"the cpu graph attention backend takes float32/float64 CPU tensors, "
                         f"got {query.dtype} on {query.device}")
    if scale is None:
        scale = query.size(-1) ** -0.5
    if graph.num_edges == 0:  # no row has a key
        return torch.zeros_like(query)
    plan = plan_on(graph, BLOCK_M, BLOCK_N, "cpu", TILES_PER_ITEM)
    return CpuGraphAttention.apply(query, key, value, rel_key, key_padding_mask, plan,
                                   float(scale), float(dropout_p))


register_backend("cpu", cpu_graph_attention, is_available)
