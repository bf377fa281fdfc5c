"""``graph_attention``: sparse multi-head attention over an explicit graph, and its backends.

One op computes for every query node u

    out_u = sum_{v in in(u), v present} softmax_v(scale * q_u . (k_v + rel_key[type(u, v)])) v_v

where ``in(u)`` is row u of a CSR adjacency (``AttentionGraph``). The graph is shared by all
sentences of a batch; sentences differ only through ``key_padding_mask``.

Backends are looked up by name; each backend module calls ``register_backend`` when it is
imported. ``"torch"`` (``torch_backend``: exact, everywhere, the reference) is imported with the
package; the optional ones (``OPTIONAL_BACKENDS``) are imported on the first call, and one that
cannot be imported stays unregistered.

``backend="auto"`` trusts a fast backend only after it has checked itself: on the first call
for a device, dtype and head dim, each registered backend of ``AUTO_PREFERENCE`` (on CPU:
``CPU_AUTO_PREFERENCE``) that can run there computes a small padded BPT graph forward and
backward, compared with the torch backend (a few milliseconds, remembered for the process).
The first that passes is used; one that fails is named in a single warning and skipped, and
the torch backend is the last resort.
"""

import importlib
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch

from fairseq_plugins.graphs.attention_graph import AttentionGraph
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present

OPTIONAL_BACKENDS = (
    "fairseq_plugins.graph_attention.cpu_backend",
    "fairseq_plugins.graph_attention.cuda_backend",
    "fairseq_plugins.graph_attention.flex_backend",
    "fairseq_plugins.graph_attention.triton_backend",
)
# fast backends "auto" may use on a CUDA tensor, best first (until a GPU measurement says
# otherwise); one that is not registered is skipped
AUTO_PREFERENCE = ("triton", "cuda")
# fast backends "auto" may use on a CPU tensor, best first: the fused "cpu" kernel is 2-7x
# faster than the torch backend at every graph size measured, from sentences of 16 tokens to
# documents of 8192 (benchmarks/graph_attention.md)
CPU_AUTO_PREFERENCE: Tuple[str, ...] = ("cpu",)
# allowed max |backend - torch| relative to the reference's magnitude, per dtype
SELF_CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}

BackendFn = Callable[..., torch.Tensor]
_BACKENDS: Dict[str, Tuple[BackendFn, Callable[..., bool]]] = {}
_OPTIONAL_IMPORT_TRIED = False
# (backend, device, dtype, head dim) -> None when the self-check passed, else the error
_SELF_CHECKS: Dict[Tuple[str, str, torch.dtype, int], Optional[str]] = {}


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
    backend: "auto" or a registered name ("torch", "cpu", "cuda", "flex", ...); "auto" = the
        first of ``AUTO_PREFERENCE`` (CUDA) or ``CPU_AUTO_PREFERENCE`` (CPU) that runs here and
        passed its self-check, else "torch".
        Returns [B, H, N, D].
    """
    _check_inputs(query, key, value, graph, rel_key, key_padding_mask)
    if scale is None:
        scale = query.size(-1) ** -0.5
    _load_optional_backends()
    if backend == "auto":
        backend = auto_backend(query)
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


def wants_fast_backend(query: torch.Tensor) -> bool:
    """Whether "auto" tries the GPU backends (``AUTO_PREFERENCE``) for these tensors: CUDA ones.

    Module-level so that tests can stand a CPU tensor in for a CUDA one."""
    return query.is_cuda


def auto_backend(query: torch.Tensor) -> str:
    """The backend ``backend="auto"`` uses for ``query`` (see the module docstring)."""
    if wants_fast_backend(query):
        candidates = AUTO_PREFERENCE
    elif query.device.type == "cpu":
        candidates = CPU_AUTO_PREFERENCE
    else:
        candidates = ()
    for name in candidates:
        entry = _BACKENDS.get(name)
        if entry is not None and entry[1](query) and passes_self_check(name, query):
            return name
    return "torch"


def passes_self_check(name: str, query: torch.Tensor) -> bool:
    """Backend ``name`` against the torch backend on ``query``'s device, dtype and head dim;
    run once per process, with one warning naming the backend and the error on failure."""
    key = (name, str(query.device), query.dtype, query.size(-1))
    if key not in _SELF_CHECKS:
        try:
            with torch.inference_mode(False), torch.enable_grad():  # whatever the caller runs in
                self_check(_BACKENDS[name][0], query.device, query.dtype, query.size(-1))
            _SELF_CHECKS[key] = None
        except Exception as error:  # any failure means: do not trust it here
            _SELF_CHECKS[key] = f"{type(error).__name__}: {error}"
            warnings.warn(f"graph attention backend {name!r} failed its self-check on "
                          f"{query.device} / {query.dtype} / head dim {query.size(-1)} and "
                          f"is not used there ({_SELF_CHECKS[key]}); using the next fast "
                          f"backend, else 'torch'", RuntimeWarning, stacklevel=3)
    return _SELF_CHECKS[key] is None


def self_check(fn: BackendFn, device, dtype, head_dim: int) -> None:
    """Raise unless ``fn`` matches the torch backend (float64, CPU) on a BPT graph of 24 tokens
    (k = 2, 2 sentences, one padded to 11 tokens, 2 heads, relative keys): output and the
    gradients of query, key, value and relative keys."""
    graph = bpt_graph(24, 2)
    gen = torch.Generator().manual_seed(0)
    shape = (2, 2, graph.num_nodes, head_dim)
    leaves = [torch.randn(shape, generator=gen) for _ in range(3)]
    leaves.append(0.5 * torch.randn(graph.num_edge_types, head_dim, generator=gen))
    grad_out = torch.randn(shape, generator=gen)
    absent = ~node_present(torch.tensor([24, 11]), 24)
    reference_fn = _BACKENDS["torch"][0]

    def outputs(backend_fn, tensors, mask, grad):
        tensors = [t.detach().requires_grad_() for t in tensors]
        out = backend_fn(*tensors[:3], graph, tensors[3], mask, 0.0, head_dim ** -0.5)
        out.backward(grad.to(out.dtype))
        return [out.detach()] + [t.grad for t in tensors]

    expected = outputs(reference_fn, [t.double() for t in leaves], absent, grad_out.double())
    actual = outputs(fn, [t.to(device, dtype) for t in leaves], absent.to(device),
                     grad_out.to(device, dtype))
    for name, a, e in zip(("output", "d query", "d key", "d value", "d rel_key"), actual, expected):
        if a is None or a.shape != e.shape or a.dtype != dtype:
            raise RuntimeError(f"{name}: got {None if a is None else (a.dtype, tuple(a.shape))}")
        error = (a.double().cpu() - e).abs().max().item()
        tolerance = SELF_CHECK_TOLERANCE.get(dtype, SELF_CHECK_TOLERANCE[torch.float32])
        if not error <= tolerance * max(1.0, e.abs().max().item()):
            raise RuntimeError(f"{name} differs from the torch backend by {error:.3g}")
