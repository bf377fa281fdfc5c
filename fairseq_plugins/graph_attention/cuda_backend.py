"""The ``"cuda"`` backend of ``graph_attention``: fused kernels from ``cuda_ext/``.

The extension is built with ``torch.utils.cpp_extension.load`` into a per-user cache
(``$FAIRSEQ_PLUGINS_CACHE`` or ``~/.cache/fairseq_plugins``; ``extension_build``) for the
architectures of ``cuda_toolkit.build_target``, either by ``fairseq-plugins-build-kernels``
during set-up or on first use; later processes reuse the build.
Importing this module needs neither nvcc nor a GPU: it only registers the backend; the
extension is loaded (built if needed) by the backend's ``prepare``, when it is about to run.

The kernels' work list (``KernelPlan``) is built here once per graph and device: rows longer
than ``SPLIT_EDGES`` edges, or whose edge types span several windows of ``TYPE_WINDOW``, are
cut into pieces merged afterwards; pieces are sorted longest first, a row's edges are ordered
by type, and the graph's index contents are validated.
The kernels are ``torch.library`` ops (``fairseq_plugins::cuda_graph_attention`` and its
backward) on the plan's tensors, registered for CUDA; the tests register the CPU host
emulation of the same kernels as the ops' CPU kernel (``tests/cuda_ext_emulation.py``), so
``fused_graph_attention`` runs the same glue, autograd and fake implementations on both.
Dropout's (seed, offset) is a tensor drawn on the query's device and read by the kernels
there.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from fairseq_plugins.graph_attention.cuda_toolkit import build_target, prepare_build
from fairseq_plugins.graph_attention.extension_build import Extension
from fairseq_plugins.graph_attention.registry import Backend
from fairseq_plugins.resources import resource_dir
from fairseq_plugins.graphs.attention_graph import AttentionGraph

SOURCE_DIR = resource_dir("cuda_ext") / "csrc"
SOURCES = (SOURCE_DIR / "graph_attention.cpp", SOURCE_DIR / "graph_attention_kernels.cu")
# torch adds -std=c++20 and its half/bfloat16 defines itself; the compile test adds -Werror
NVCC_FLAGS = ("-O3", "--expt-relaxed-constexpr")
CXX_FLAGS = ("-O3",)
HEAD_DIMS = (32, 64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rows with more edges are split across warps. BPT at n = 8192, k = 4 has 49 edges per row
# on average and a root row of 8192: 256 keeps ordinary rows whole and cuts the long ones
# into warp-sized work.
SPLIT_EDGES = 256
# The dQ kernel sums dS per edge type in registers over a window of this many types
# (kTypeWindow in the kernels): a row whose types span several windows is split there.
TYPE_WINDOW = 128
INT32_MAX = 2**31 - 1

EXTENSION = Extension(
    "fairseq_plugins_graph_attention_cuda", "cuda_ext",
    f"torch{torch.__version__}-cuda{torch.version.cuda}", SOURCES, cflags=CXX_FLAGS,
    cuda_cflags=NVCC_FLAGS, include_dirs=(SOURCE_DIR,),
    requirement=prepare_build, target=build_target)


def load_extension(verbose: bool = False):
    """Build (first time, a few minutes) or load the cached extension; raises on failure."""
    return EXTENSION.load(verbose)


def supports(query: torch.Tensor) -> bool:
    """Whether the kernels handle this dtype and shape (on any device)."""
    return query.dtype in DTYPES and query.dim() == 4 and query.size(-1) in HEAD_DIMS


def refuses(query: torch.Tensor, graph: AttentionGraph, dropout_p: float = 0.0):
    """Why the kernels cannot run these inputs (None: they can): CUDA tensors of a dtype and
    head dim they are compiled for, a square graph. Builds nothing."""
    if not query.is_cuda:
        return f"CUDA tensors only, got {query.device}"
    if not supports(query):
        return f"dtypes {DTYPES} and head dims {HEAD_DIMS}, got {query.dtype} / {query.size(-1)}"
    if not graph.square:
        return "square graphs only (a decoding step's graph runs on the torch backend)"
    return None


# ------------------------------------------------------------------------ the work plan

@dataclass(frozen=True)
class WorkSchedule:
    """The warps' work over one CSR (see cuda_ext/csrc/graph_attention.h)."""

    pieces: torch.Tensor  # int32 [P, 5]: row, begin, end, slot (-1: whole row), multi-type
    merges: torch.Tensor  # int32 [S, 4]: row, first slot, slot count, multi-type
    num_slots: int

    def to(self, device) -> "WorkSchedule":
        return WorkSchedule(self.pieces.to(device), self.merges.to(device), self.num_slots)

    def args(self):
        return self.pieces, self.merges, self.num_slots


@dataclass(frozen=True)
class KernelPlan:
    """A graph as the kernels read it: CSR by query with each row's edges ordered by type,
    the transposed CSR, and the work schedules of both."""

    indices: torch.Tensor  # int32 [E], key of each edge, in kernel order
    edge_type: torch.Tensor  # int32 [E]
    edge_order: torch.Tensor  # int64 [E], the graph's edge id at each kernel position
    by_query: WorkSchedule
    t_query: torch.Tensor  # int32 [E], query node of each edge, CSR by key
    t_edge: torch.Tensor  # int32 [E], kernel position of that edge
    by_key: WorkSchedule

    def to(self, device) -> "KernelPlan":
        return KernelPlan(self.indices.to(device), self.edge_type.to(device), self.edge_order,
                          self.by_query.to(device), self.t_query.to(device),
                          self.t_edge.to(device), self.by_key.to(device))


def validate_graph(graph: AttentionGraph) -> None:
    """The index contents the kernels rely on: indptr from 0 to E and monotone, keys and
    types in range, sizes within int32. Raises ValueError."""
    indptr, n, e = graph.indptr, graph.num_nodes, graph.num_edges
    if max(n, e, graph.num_edge_types) > INT32_MAX:
        raise ValueError(f"graph_attention_cuda: {n} nodes / {e} edges exceed int32 indices")
    if indptr.shape != (n + 1,) or int(indptr[0]) != 0 or int(indptr[-1]) != e:
        raise ValueError(f"graph_attention_cuda: indptr must have {n + 1} entries from 0 to {e}")
    if bool((indptr.diff() < 0).any()):
        raise ValueError("graph_attention_cuda: indptr must be non-decreasing")
    for name, values, bound in (("key index", graph.indices, n),
                                ("edge type", graph.edge_type, graph.num_edge_types)):
        if values.shape != (e,):
            raise ValueError(f"graph_attention_cuda: {name}s must have {e} entries")
        if e and (int(values.min()) < 0 or int(values.max()) >= bound):
            raise ValueError(f"graph_attention_cuda: {name} out of range [0, {bound})")


def work_schedule(indptr: torch.Tensor, multi_type: torch.Tensor,
                  split_edges: int = SPLIT_EDGES, window=None) -> WorkSchedule:
    """Pieces of at most ``split_edges`` edges per CSR row (one, possibly empty, for short
    rows), longest first; the slots and merges of the rows split into several pieces.
    ``window`` (int64 [E], non-decreasing within rows): a piece never spans two values."""
    if split_edges < 1:
        raise ValueError(f"split_edges must be >= 1, got {split_edges}")
    num_rows, num_edges = indptr.numel() - 1, int(indptr[-1])
    lengths = indptr.diff()
    rows = torch.repeat_interleave(torch.arange(num_rows), lengths)
    # segments: the runs of a row with one window value; a row without edges is one
    starts = torch.zeros(num_edges, dtype=torch.bool)
    if window is not None and num_edges:
        starts[1:] = window[1:] != window[:-1]
    starts[indptr[:-1][lengths > 0]] = True
    empty = (lengths == 0).nonzero().flatten()
    seg_begin = torch.cat([starts.nonzero().flatten(), indptr[empty]])
    seg_row = torch.cat([rows[starts], empty])
    order = torch.argsort(seg_row * (num_edges + 1) + seg_begin)
    seg_begin, seg_row = seg_begin[order], seg_row[order]
    next_begin = torch.cat([seg_begin[1:], seg_begin.new_tensor([num_edges])])
    seg_end = torch.minimum(next_begin, indptr[seg_row + 1])
    chunks = ((seg_end - seg_begin + split_edges - 1) // split_edges).clamp_min(1)
    segment = torch.repeat_interleave(torch.arange(seg_begin.numel()), chunks)
    local = torch.arange(segment.numel()) - (chunks.cumsum(0) - chunks)[segment]
    row = seg_row[segment]
    begin = seg_begin[segment] + local * split_edges
    end = torch.minimum(begin + split_edges, seg_end[segment])
    counts = torch.bincount(row, minlength=num_rows)
    local = torch.arange(row.numel()) - (counts.cumsum(0) - counts)[row]
    split = counts[row] > 1
    slot = torch.where(split, split.long().cumsum(0) - 1, torch.full_like(row, -1))
    multi = multi_type.long()[row]
    pieces = torch.stack([row, begin, end, slot, multi], 1)
    order = torch.argsort(end - begin, descending=True, stable=True)
    first = split & (local == 0)
    merges = torch.stack([row[first], slot[first], counts[row[first]], multi[first]], 1)
    return WorkSchedule(pieces[order].to(torch.int32).contiguous(),
                        merges.to(torch.int32).contiguous(), int(split.sum()))


def kernel_plan(graph: AttentionGraph, split_edges: int = SPLIT_EDGES) -> KernelPlan:
    """Validate ``graph`` and build the kernels' view of it (CPU tensors)."""
    validate_graph(graph)
    n, num_types = graph.num_nodes, graph.num_edge_types
    rows = graph.rows()
    # within a row, edges by (type, key): each (row, type) is one run of the dQ kernel
    order = torch.argsort((rows * num_types + graph.edge_type) * n + graph.indices)
    indices, edge_type = graph.indices[order], graph.edge_type[order]
    run_start = torch.ones(order.numel(), dtype=torch.bool)
    run_start[1:] = (edge_type[1:] != edge_type[:-1]) | (rows[1:] != rows[:-1])
    multi_type = torch.bincount(rows[run_start], minlength=n) > 1
    by_query = work_schedule(graph.indptr, multi_type, split_edges,
                             torch.div(edge_type, TYPE_WINDOW, rounding_mode="floor"))

    by_key_order = torch.argsort(indices * n + rows)  # rows are unchanged by `order`
    t_indptr = torch.cat([graph.indptr.new_zeros(1),
                          torch.bincount(indices, minlength=n).cumsum(0)])
    by_key = work_schedule(t_indptr, torch.zeros(n, dtype=torch.bool), split_edges)
    return KernelPlan(indices.to(torch.int32), edge_type.to(torch.int32), order, by_query,
                      rows[by_key_order].to(torch.int32), by_key_order.to(torch.int32), by_key)


def plan_on(graph: AttentionGraph, device, split_edges: int = SPLIT_EDGES) -> KernelPlan:
    """``kernel_plan`` on ``device``, cached on the graph."""
    return graph.derived("cuda_plan", device, lambda: kernel_plan(graph, split_edges).to(device),
                         split_edges)


# ------------------------------------------------------------------------------- the op
# The kernels as torch.library ops on tensors (the plan's, the dropout's (seed, offset)), with
# fake implementations and registered autograd: torch.compile traces them without a graph
# break. Registered for CUDA; the op body loads (or builds) the extension when it first runs.

def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, with the 16-byte alignment the vector loads need (in the op body: the
    real tensors, never fake ones)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def run_forward(extension, q, k, v, rel, pad, indices, edge_type, q_pieces, q_merges, q_num_slots, t_query,
                t_edge, k_pieces, k_merges, k_num_slots, scale, dropout_p, rng):
    """The forward op's body on a build of the kernels (``extension``); the op's parameters
    (the transposed plan is there for the backward)."""
    out, lse = extension.forward(_aligned(q), _aligned(k), _aligned(v),
                                 None if rel is None else _aligned(rel), indices, edge_type, q_pieces,
                                 q_merges, q_num_slots, pad, scale, dropout_p, rng)
    return out, lse


def run_backward(extension, grad_out, q, k, v, out, lse, rel, pad, indices, edge_type, q_pieces, q_merges,
                 q_num_slots, t_query, t_edge, k_pieces, k_merges, k_num_slots, scale, dropout_p, rng,
                 need_rel_grad):
    """The backward op's body on a build of the kernels (``extension``)."""
    return tuple(extension.backward(
        _aligned(grad_out), _aligned(q), _aligned(k), _aligned(v), None if rel is None else _aligned(rel),
        _aligned(out), lse, rng, indices, edge_type, q_pieces, q_merges, q_num_slots, t_query, t_edge,
        k_pieces, k_merges, k_num_slots, pad, scale, dropout_p, need_rel_grad))


@torch.library.custom_op("fairseq_plugins::cuda_graph_attention", mutates_args=(), device_types="cuda")
def forward_op(q: Tensor, k: Tensor, v: Tensor, rel: Optional[Tensor], pad: Optional[Tensor],
               indices: Tensor, edge_type: Tensor, q_pieces: Tensor, q_merges: Tensor, q_num_slots: int,
               t_query: Tensor, t_edge: Tensor, k_pieces: Tensor, k_merges: Tensor, k_num_slots: int,
               scale: float, dropout_p: float, rng: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """q, k, v: [B, H, N, D]; rel: [T, D] of their dtype; pad: bool [B, N]; the whole
    ``KernelPlan`` (the transposed half for the backward); rng: int64 [2] (seed, offset) on
    the device, or None without dropout. Returns (out [B, H, N, D], lse float32 [B, H, N])."""
    return run_forward(load_extension(), q, k, v, rel, pad, indices, edge_type, q_pieces, q_merges, q_num_slots,
                       t_query, t_edge, k_pieces, k_merges, k_num_slots, scale, dropout_p, rng)


@forward_op.register_fake
def _forward_fake(q, k, v, rel, pad, indices, edge_type, q_pieces, q_merges, q_num_slots, t_query, t_edge,
                  k_pieces, k_merges, k_num_slots, scale, dropout_p, rng):
    # contiguous whatever the inputs' strides, as the kernels' outputs are
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fairseq_plugins::cuda_graph_attention_backward", mutates_args=(),
                         device_types="cuda")
def backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                rel: Optional[Tensor], pad: Optional[Tensor], indices: Tensor, edge_type: Tensor,
                q_pieces: Tensor, q_merges: Tensor, q_num_slots: int, t_query: Tensor, t_edge: Tensor,
                k_pieces: Tensor, k_merges: Tensor, k_num_slots: int, scale: float, dropout_p: float,
                rng: Optional[Tensor], need_rel_grad: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d q, d k, d v, d rel: [T, D], or [0, D] unless ``need_rel_grad``), recomputed from
    ``lse``; the forward's dropout mask, regenerated from the same ``rng`` tensor."""
    return run_backward(load_extension(), grad_out, q, k, v, out, lse, rel, pad, indices, edge_type, q_pieces,
                        q_merges, q_num_slots, t_query, t_edge, k_pieces, k_merges, k_num_slots, scale,
                        dropout_p, rng, need_rel_grad)


@backward_op.register_fake
def _backward_fake(grad_out, q, k, v, out, lse, rel, pad, indices, edge_type, q_pieces, q_merges, q_num_slots,
                   t_query, t_edge, k_pieces, k_merges, k_num_slots, scale, dropout_p, rng, need_rel_grad):
    grad_rel = q.new_empty((rel.size(0) if need_rel_grad else 0, q.size(-1)))
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape), grad_rel


def _setup_context(ctx, inputs, output):
    (q, k, v, rel, pad, indices, edge_type, q_pieces, q_merges, q_num_slots, t_query, t_edge, k_pieces,
     k_merges, k_num_slots, scale, dropout_p, rng) = inputs
    ctx.save_for_backward(q, k, v, *output, rel, pad, indices, edge_type, q_pieces, q_merges, t_query,
                          t_edge, k_pieces, k_merges, rng)
    ctx.scalars = (q_num_slots, k_num_slots, scale, dropout_p)


def _backward(ctx, grad_out, grad_lse):
    (q, k, v, out, lse, rel, pad, indices, edge_type, q_pieces, q_merges, t_query, t_edge, k_pieces,
     k_merges, rng) = ctx.saved_tensors
    q_num_slots, k_num_slots, scale, dropout_p = ctx.scalars
    need_rel_grad = rel is not None and ctx.needs_input_grad[3]
    grad_q, grad_k, grad_v, grad_rel = backward_op(
        grad_out, q, k, v, out, lse, rel, pad, indices, edge_type, q_pieces, q_merges, q_num_slots, t_query,
        t_edge, k_pieces, k_merges, k_num_slots, scale, dropout_p, rng, need_rel_grad)
    return (grad_q, grad_k, grad_v, grad_rel if need_rel_grad else None) + (None,) * 14


torch.library.register_autograd("fairseq_plugins::cuda_graph_attention", _backward,
                                setup_context=_setup_context)


def fused_graph_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                          dropout_p=0.0, scale=None, seed=None, split_edges: int = SPLIT_EDGES):
    """``graph_attention`` through the kernels' ops (the CUDA build on CUDA tensors; tests
    register the host emulation as the ops' CPU kernel); ``seed``: the dropout stream
    (``registry.dropout_seed``), needed with dropout."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and seed is None:
        raise ValueError("dropout needs the op's seed tensor: pass seed=registry.dropout_seed(device, dropout_p)")
    if scale is None:
        scale = query.size(-1) ** -0.5
    if rel_key is not None:
        rel_key = rel_key.to(query.dtype)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=query.device, dtype=torch.bool).contiguous()
    plan = plan_on(graph, query.device, split_edges)
    out, _ = forward_op(query, key, value, rel_key, key_padding_mask, plan.indices, plan.edge_type,
                        *plan.by_query.args(), plan.t_query, plan.t_edge, *plan.by_key.args(), float(scale),
                        float(dropout_p), seed if dropout_p > 0 else None)
    return out


def cuda_graph_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                         dropout_p=0.0, scale=None, seed=None):
    """Backend function (see ``graph_attention`` for the semantics)."""
    return fused_graph_attention(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale, seed)


def prepare(query: torch.Tensor, graph: AttentionGraph) -> None:
    """Load (or build) the extension and the graph's work plan on the query's device."""
    load_extension()
    plan_on(graph, query.device)


BACKEND = Backend("cuda", cuda_graph_attention, refuses, prepare, seeded=True)
