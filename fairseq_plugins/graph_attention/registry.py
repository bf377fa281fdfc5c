"""``graph_attention``: sparse multi-head attention over an explicit graph, and its backends.

One op computes for every query node u

    out_u = sum_{v in in(u), v present} softmax_v(scale * q_u . (k_v + rel_key[type(u, v)])) v_v

where ``in(u)`` is row u of a CSR adjacency (``AttentionGraph``). The graph is shared by all
sentences of a batch; sentences differ only through ``key_padding_mask``.

Backends are looked up by name; each backend module calls ``register_backend`` when it is
imported. ``"torch"`` (``torch_backend``: exact, everywhere, the reference) is imported with the
package; the optional ones (``OPTIONAL_BACKENDS``) are imported on the first call, and one that
cannot be imported stays unregistered.
"""

import importlib
from typing import Callable, Dict, Optional, Tuple

import torch

from fairseq_plugins.graphs.attention_graph import AttentionGraph

OPTIONAL_BACKENDS = (
    "fairseq_plugins.graph_attention.cuda_backend",
    "fairseq_plugins.graph_attention.flex_backend",
    "fairseq_plugins.graph_attention.triton_backend",
)

BackendFn = Callable[..., torch.Tensor]
_BACKENDS: Dict[str, Tuple[BackendFn, Callable[..., bool]]] = {}
_OPTIONAL_IMPORT_TRIED = False


def register_backend(name: str, fn: BackendFn, is_available: Callable[..., bool]) -> None:
    """Register ``fn(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale)``.

    ``is_available(query)`` says whether the backend can run on these tensors."""
    _BACKENDS[name] = (fn, is_available)


def _load_optional_backends() -> None:
    """Import the optional backends once; one that cannot be imported stays unregistered."""
    global _OPTIONAL_IMPORT_TRIED
    if not _OPTIONAL_IMPORT_TRIED:
        _OPTIONAL_IMPORT_TRIED = True
        for module in OPTIONAL_BACKENDS:  # each registers itself
            try:
                importlib.import_module(module)
            except ImportError:
                pass


def graph_attention(
    query, key, value, graph: AttentionGraph, rel_key=None, key_padding_mask=None,
    dropout_p: float = 0.0, scale: Optional[float] = None, backend: str = "auto",
) -> torch.Tensor:
    """query, key, value: [B, H, N, D] (same dtype/device); graph: AttentionGraph over N nodes.

    rel_key: [graph.num_edge_types, D] or None; one learned vector per edge type, shared by
        heads, added to keys: score(u, v) = scale * q_u . (k_v + rel_key[type(u, v)]); scale
        defaults to D ** -0.5.
    key_padding_mask: [B, N] bool or None, True = node absent in that sentence (padding or a
        span that covers only padding): never attended to.
    A query row with no present in-neighbour returns zeros (and zero gradients).
    dropout_p: attention-probability dropout (applied after softmax, like fairseq).
    backend: "auto" | "torch" | "cuda" | "flex"; "auto" = "cuda" for CUDA tensors when the
        extension is available, else "torch". Returns [B, H, N, D].
    """
    _check_inputs(query, key, value, graph, rel_key, key_padding_mask)
    if scale is None:
        scale = query.size(-1) ** -0.5
    _load_optional_backends()
    if backend == "auto":
        cuda = _BACKENDS.get("cuda")
        backend = "cuda" if cuda is not None and query.is_cuda and cuda[1](query) else "torch"
    if backend not in _BACKENDS:
        raise ValueError(f"graph attention backend {backend!r} is not registered "
                         f"(available: {sorted(_BACKENDS)})")
    fn, is_available = _BACKENDS[backend]
    if not is_available(query):
        raise RuntimeError(f"graph attention backend {backend!r} cannot run on "
                           f"{query.device} / {query.dtype} tensors")
    return fn(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale)


def _check_inputs(query, key, value, graph, rel_key, key_padding_mask):
    if query.dim() != 4 or query.shape != key.shape or key.shape != value.shape:
        raise ValueError(f"query/key/value must all be [B, H, N, D]; got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.size(2) != graph.num_nodes:
        raise ValueError(f"inputs have {query.size(2)} nodes, graph has {graph.num_nodes}")
    if rel_key is not None and rel_key.shape != (graph.num_edge_types, query.size(-1)):
        raise ValueError(f"rel_key must be [{graph.num_edge_types}, {query.size(-1)}], "
                         f"got {tuple(rel_key.shape)}")
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool
        or key_padding_mask.shape != (query.size(0), graph.num_nodes)
    ):
        raise ValueError("key_padding_mask must be a bool [B, N] tensor")
