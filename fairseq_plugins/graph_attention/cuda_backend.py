"""The ``"cuda"`` backend of ``graph_attention``: fused kernels from ``cuda_ext/``.

The extension is built with ``torch.utils.cpp_extension.load`` into a per-user cache
(``$FAIRSEQ_PLUGINS_CACHE`` or ``~/.cache/fairseq_plugins``), either by
``scripts/build_cuda_ext.py`` during set-up or on first use; later processes reuse the build.
Importing this module needs neither nvcc nor a GPU: it only registers the backend, whose
``is_available`` says no (and warns once, with the reason) when the kernels cannot run.
"""

import logging
import os
import threading
from pathlib import Path

import torch
from torch.utils import cpp_extension

from fairseq_plugins.graph_attention.registry import register_backend
from fairseq_plugins.graphs.attention_graph import AttentionGraph

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parents[2] / "cuda_ext" / "csrc"
SOURCES = (SOURCE_DIR / "graph_attention.cpp", SOURCE_DIR / "graph_attention_kernels.cu")
# torch adds -std=c++20 and its half/bfloat16 defines itself; the compile test adds -Werror
NVCC_FLAGS = ("-O3", "--expt-relaxed-constexpr")
CXX_FLAGS = ("-O3",)
HEAD_DIMS = (32, 64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BATCH_HEADS = 65535  # grid.y of the kernels

_lock = threading.Lock()
_extension = None
_load_error = None


def build_directory() -> Path:
    """Where the extension is built and cached, one folder per torch/CUDA version."""
    root = Path(os.environ.get("FAIRSEQ_PLUGINS_CACHE", Path.home() / ".cache" / "fairseq_plugins"))
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}".replace("+", "_")
    return root / "cuda_ext" / tag


def load_extension(verbose: bool = False):
    """Build (first time, a few minutes) or load the cached extension; raises on failure."""
    global _extension
    with _lock:
        if _extension is None:
            missing = [str(s) for s in SOURCES if not s.is_file()]
            if missing:
                raise RuntimeError(f"cuda backend: sources not found: {missing}")
            if torch.version.cuda is None:
                raise RuntimeError("cuda backend: this torch build has no CUDA support")
            directory = build_directory()
            directory.mkdir(parents=True, exist_ok=True)
            _extension = cpp_extension.load(
                name="fairseq_plugins_graph_attention_cuda",
                sources=[str(s) for s in SOURCES],
                extra_cflags=list(CXX_FLAGS),
                extra_cuda_cflags=list(NVCC_FLAGS),
                extra_include_paths=[str(SOURCE_DIR)],
                build_directory=str(directory),
                verbose=verbose,
            )
    return _extension


def extension_available() -> bool:
    """True when the kernels are built (or can be built now) and a GPU is present."""
    global _load_error
    if not torch.cuda.is_available():
        return False
    if _load_error is None:
        try:
            load_extension()
        except Exception as error:  # a broken toolchain must not break the torch backend
            _load_error = error
            logger.warning("graph attention CUDA kernels unavailable, using the torch "
                           "backend: %s", error)
    return _load_error is None


def is_available(query: torch.Tensor) -> bool:
    """Whether the kernels support these inputs (CUDA, dtype, head dim, batch * heads)."""
    return (
        query.is_cuda
        and query.dtype in DTYPES
        and query.dim() == 4
        and query.size(-1) in HEAD_DIMS
        and query.size(0) * query.size(1) <= MAX_BATCH_HEADS
        and extension_available()
    )


def _graph_tensors(graph: AttentionGraph, device: torch.device):
    """int32 CSR by query and by key (query node, edge id) on ``device``, cached on the graph."""
    if graph.num_edges >= 2**31:
        raise ValueError(f"cuda backend: {graph.num_edges} edges exceed int32 indices")
    indptr, indices, edge_type = graph.on(device, torch.int32)
    key = ("cuda_transposed", str(device))
    if key not in graph._cache:
        graph._cache[key] = tuple(t.to(device=device, dtype=torch.int32)
                                  for t in graph.transposed())
    return (indptr, indices, edge_type) + graph._cache[key]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, with the 16-byte alignment the vector loads need."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class GraphAttentionFunction(torch.autograd.Function):
    """Fused forward; backward recomputes probabilities from the saved log-sum-exp."""

    @staticmethod
    def forward(ctx, query, key, value, rel_key, csr, key_padding_mask, scale, dropout_p):
        ext = load_extension()
        indptr, indices, edge_type, t_indptr, t_query, t_edge = csr
        out, lse, rng_state = ext.forward(query, key, value, rel_key, indptr, indices, edge_type,
                                          key_padding_mask, scale, dropout_p)
        ctx.save_for_backward(query, key, value, rel_key, out, lse, key_padding_mask)
        ctx.csr, ctx.rng_state = csr, rng_state
        ctx.scale, ctx.dropout_p = scale, dropout_p
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, rel_key, out, lse, key_padding_mask = ctx.saved_tensors
        indptr, indices, edge_type, t_indptr, t_query, t_edge = ctx.csr
        need_rel_grad = rel_key is not None and ctx.needs_input_grad[3]
        dq, dk, dv, drel = load_extension().backward(
            _aligned(grad_out), query, key, value, rel_key, out, lse, ctx.rng_state, indptr,
            indices, edge_type, t_indptr, t_query, t_edge, key_padding_mask, ctx.scale,
            ctx.dropout_p, need_rel_grad)
        return dq, dk, dv, (drel if need_rel_grad else None), None, None, None, None


def cuda_graph_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                         dropout_p=0.0, scale=None):
    """Backend function (see ``graph_attention`` for the semantics)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is None:
        scale = query.size(-1) ** -0.5
    if rel_key is not None:
        rel_key = _aligned(rel_key.to(query.dtype))
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=query.device, dtype=torch.bool).contiguous()
    csr = _graph_tensors(graph, query.device)
    return GraphAttentionFunction.apply(_aligned(query), _aligned(key), _aligned(value), rel_key,
                                        csr, key_padding_mask, float(scale), float(dropout_p))


register_backend("cuda", cuda_graph_attention, is_available)
