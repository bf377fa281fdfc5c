"""The ``"cpu"`` backend of ``graph_attention``: a fused C++ kernel (``cpu_ext/``) that walks
the graph's edges.

For every query row it computes the scores of the row's present keys, their softmax and the
output in one pass over rows already in cache, vectorized over the head dim, and saves one
log-sum-exp per row; the backward recomputes the probabilities edge by edge (flash
attention's recompute, without tiles: a CPU has no tensor cores to fill, and BPT's 32 x 32
tiles are three quarters non-edges). No [rows x keys] probabilities are stored, and the work
is proportional to the edges, so time and memory grow like n log n at any k. Any
``AttentionGraph`` runs, tree-laid or not.

The kernel's tensors are node-major ([N, B * H, D] in memory): a [B, H, N, D] query, key or
value that is a view of fairseq's time-first [N, B, H * D] projection output (``split_heads``)
is read where it is, and the output is returned as such a view, so that ``merge_heads`` is
free too; the gradients come back in the same layout. Inputs in another layout are copied
into it once.

float32 and float64 (the tests compare float64 with the reference to ~1e-12); float16 and
bfloat16 inputs (autocast) are computed in float32 and returned in their own dtype. The
extension is built on first use or by ``fairseq-plugins-build-kernels`` into the per-user cache
(``extension_build``); under "auto" a failed build fails the self-check (one warning) and
leaves the torch backend in use.
"""

import hashlib
import platform
from typing import Optional, Tuple

import torch
from torch import Tensor

from fairseq_plugins.graph_attention.extension_build import Extension
from fairseq_plugins.graph_attention.registry import Backend
from fairseq_plugins.resources import resource_dir

SOURCE_DIR = resource_dir("cpu_ext") / "csrc"
DTYPES = (torch.float32, torch.float64)  # what the kernel computes in
HALF_DTYPES = (torch.float16, torch.bfloat16)  # computed in float32
# the build is for the CPU that builds it (the cache folder names the CPU's features): AVX2/AVX-512
# for the loops over the head dim, which ``#pragma omp simd`` vectorizes (reductions in a
# fixed lane order); OpenMP, without which at::parallel_for (inline in torch's headers) runs
# serially; no errno from math functions
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
    "fairseq_plugins_graph_attention_cpu", "cpu_ext",
    f"torch{torch.__version__}-{cpu_features()}",
    (SOURCE_DIR / "graph_attention_cpu.cpp",), cflags=CXX_FLAGS, ldflags=("-fopenmp",))


def load_extension(verbose: bool = False):
    """Build (first time, about a minute) or load the cached extension; raises on failure."""
    return EXTENSION.load(verbose)


def refuses(query: torch.Tensor, graph, dropout_p: float = 0.0):
    """Why the kernel cannot run these inputs (None: it can): CPU tensors of float32/float64
    over a square graph. Builds nothing."""
    if query.device.type != "cpu":
        return f"CPU tensors only, got {query.device}"
    if query.dtype not in DTYPES + HALF_DTYPES:
        return f"float32/float64 (and float16/bfloat16, computed in float32) only, got {query.dtype}"
    if not graph.square:
        return "square graphs only (a decoding step's graph runs on the torch backend)"
    return None


# The kernels as torch.library ops on tensors (the graph's CSR, the dropout seed), with fake
# implementations: torch.compile traces them without a graph break.

@torch.library.custom_op("fairseq_plugins::cpu_graph_attention", mutates_args=())
def forward_op(q: Tensor, k: Tensor, v: Tensor, rel: Optional[Tensor], pad: Optional[Tensor],
               indptr: Tensor, indices: Tensor, edge_type: Tensor, heads: int, scale: float,
               dropout_p: float, seed: Tensor) -> Tuple[Tensor, Tensor]:
    """q, k, v: contiguous node-major [N, BH, D] float32/float64; rel: [T, D] of their dtype; pad:
    uint8 [B, N]; the CSR as int32; seed: int64 scalar. Returns (out [N, BH, D], lse [BH, N])."""
    return tuple(load_extension().forward(q, k, v, rel, pad, [indptr, indices, edge_type], heads, scale,
                                          dropout_p, int(seed)))


@forward_op.register_fake
def _forward_fake(q, k, v, rel, pad, indptr, indices, edge_type, heads, scale, dropout_p, seed):
    return torch.empty_like(q), q.new_empty((q.size(1), q.size(0)))


@torch.library.custom_op("fairseq_plugins::cpu_graph_attention_backward", mutates_args=())
def backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                rel: Optional[Tensor], pad: Optional[Tensor], indptr: Tensor, indices: Tensor,
                edge_type: Tensor, heads: int, scale: float, dropout_p: float,
                seed: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d q, d k, d v, d rel: [T, D], [0, D] without rel), recomputed from ``lse``; the same
    dropout mask as the forward's (same seed)."""
    return tuple(load_extension().backward(grad_out, q, k, v, out, lse, rel, pad,
                                           [indptr, indices, edge_type], heads, scale, dropout_p,
                                           int(seed)))


@backward_op.register_fake
def _backward_fake(grad_out, q, k, v, out, lse, rel, pad, indptr, indices, edge_type, heads, scale,
                   dropout_p, seed):
    grad_rel = q.new_empty((0 if rel is None else rel.size(0), q.size(-1)))
    return torch.empty_like(q), torch.empty_like(q), torch.empty_like(q), grad_rel


def _setup_context(ctx, inputs, output):
    q, k, v, rel, pad, indptr, indices, edge_type, heads, scale, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, *output, rel, pad, indptr, indices, edge_type, seed)
    ctx.scalars = (heads, scale, dropout_p)
    ctx.set_materialize_grads(False)  # lse gets no gradient: no zeros to fill


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, rel, pad, indptr, indices, edge_type, seed = ctx.saved_tensors
    heads, scale, dropout_p = ctx.scalars
    if grad_out is None:  # the output does not reach the loss
        grad_out = torch.zeros_like(out)
    grad_q, grad_k, grad_v, grad_rel = backward_op(
        grad_out.contiguous(), q, k, v, out, lse, rel, pad, indptr, indices, edge_type, heads, scale,
        dropout_p, seed)
    return (grad_q, grad_k, grad_v, None if rel is None else grad_rel, None, None, None, None, None, None,
            None, None)


torch.library.register_autograd("fairseq_plugins::cpu_graph_attention", _backward,
                                setup_context=_setup_context)


def cpu_graph_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                        dropout_p=0.0, scale=None, seed=None):
    """Backend function (see ``graph_attention`` for the semantics), called by it with checked
    inputs that this backend accepts (``refuses``), a float scale, a graph with edges and,
    with dropout, the op's seed tensor (``registry.dropout_seed``)."""
    bsz, heads, num_nodes, dim = query.shape
    compute = query.dtype if query.dtype in DTYPES else torch.float32  # autograd casts back
    q, k, v = (node_major(x).to(compute) for x in (query, key, value))
    rel = None if rel_key is None else rel_key.to(compute).contiguous()
    pad = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    # the seed as a tensor (no host read while tracing); unread without dropout
    seed = torch.zeros((), dtype=torch.int64) if seed is None else seed[0]
    out, _ = forward_op(q, k, v, rel, pad, *graph.on("cpu", torch.int32), heads, float(scale),
                        float(dropout_p), seed)
    return out.view(num_nodes, bsz, heads, dim).permute(1, 2, 0, 3).to(query.dtype)


def node_major(x: Tensor) -> Tensor:
    """[B, H, N, D] -> the kernel's contiguous [N, B * H, D]: a view when ``x`` is one of a
    time-first [N, B, H, D] tensor (``split_heads`` of a projection), else a copy."""
    bsz, heads, num_nodes, dim = x.shape
    return x.permute(2, 0, 1, 3).contiguous().view(num_nodes, bsz * heads, dim)


def prepare(query: torch.Tensor, graph) -> None:
    """Load (or build) the extension and the graph's int32 CSR."""
    load_extension()
    graph.on("cpu", torch.int32)


BACKEND = Backend("cpu", cpu_graph_attention, refuses, prepare, seeded=True)
