"""``graph_attention``: sparse multi-head attention over an explicit graph, and its backends.

One op computes for every query node u

    out_u = sum_{v in in(u), v present} softmax_v(scale * q_u . (k_v + rel_key[type(u, v)])) v_v

where ``in(u)`` is row u of a CSR adjacency (``AttentionGraph``). The graph is shared by all
sentences of a batch; sentences differ only through ``key_padding_mask``.

Backends are looked up by name (``Backend``); each backend module calls ``register_backend``
when it is imported. ``"torch"`` (``torch_backend``: exact, everywhere, the reference) is
imported with the package; the optional ones (``OPTIONAL_BACKENDS``) on the first call. One
whose module cannot be imported is reported: its error is kept (``backend_import_errors``),
named when the backend is asked for, and warned about unless only an optional dependency
(Triton) is missing. A backend says why it cannot run some inputs (``refuses``, a pure check
of devices, dtypes, shapes and limits) apart from getting ready (``prepare``: build or load
its kernels), which happens only when it is about to be used.

``backend="auto"`` trusts a fast backend only after it has checked itself: on the first call
for a device, dtype and head dim, each registered backend of ``AUTO_PREFERENCE`` (on CPU:
``CPU_AUTO_PREFERENCE``) that accepts the inputs gets ready and computes a small padded BPT
graph forward and backward, compared with the torch backend (remembered for the process).
The first that passes is used; one that fails is named in a single warning and skipped, and
the torch backend is the last resort.
"""

import functools
import importlib
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from fairseq_plugins.graph_attention.precision import autocast_inputs, autocast_off
from fairseq_plugins.graphs.attention_graph import AttentionGraph
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present

# backend name -> the module that registers it
OPTIONAL_BACKENDS = {
    "cpu": "fairseq_plugins.graph_attention.cpu_backend",
    "cuda": "fairseq_plugins.graph_attention.cuda_backend",
    "flex": "fairseq_plugins.graph_attention.flex_backend",
    "triton": "fairseq_plugins.graph_attention.triton_backend",
}
# fast backends "auto" may use on a CUDA tensor, best first (until a GPU measurement says
# otherwise); one that is not registered is skipped
AUTO_PREFERENCE = ("triton", "cuda")
# fast backends "auto" may use on a CPU tensor, best first: the fused "cpu" kernel is 2-7x
# faster than the torch backend at every graph size measured, from sentences of 16 tokens to
# documents of 8192 (benchmarks/graph_attention.md)
CPU_AUTO_PREFERENCE: Tuple[str, ...] = ("cpu",)
SELF_CHECK_GRAPH = functools.partial(bpt_graph, 24, 2)
# allowed max |backend - torch| relative to the reference's magnitude, per dtype
SELF_CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}

BackendFn = Callable[..., torch.Tensor]
# (query, graph, dropout_p) -> why the backend cannot run these inputs, or None
Refusal = Callable[[torch.Tensor, AttentionGraph, float], Optional[str]]


def _accepts_everything(query, graph, dropout_p) -> Optional[str]:
    return None


def _ready(query, graph) -> None:
    return None


@dataclass(frozen=True)
class Backend:
    """A registered implementation of the op.

    ``fn(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale)``;
    ``refuses(query, graph, dropout_p)``: the reason it cannot run these inputs, or None
    (cheap and side-effect free: it never builds anything); ``prepare(query, graph)``: build
    or load what ``fn`` needs for such a query (kernels, the graph's derived data), raising
    when that is impossible here; called before each use, outside any ``torch.compile``
    trace (so ``fn`` only reads what it prepared), and cheap once done."""

    name: str
    fn: BackendFn
    refuses: Refusal = _accepts_everything
    prepare: Callable[[torch.Tensor, AttentionGraph], None] = _ready


_BACKENDS: Dict[str, Backend] = {}
_IMPORT_ERRORS: Dict[str, str] = {}  # backend name -> why its module did not import
_OPTIONAL_IMPORT_TRIED = False
# (backend, device, dtype, head dim, rel_key dtype) -> None when the self-check passed, else the error
_SELF_CHECKS: Dict[Tuple[str, str, torch.dtype, int, torch.dtype], Optional[str]] = {}


def register_backend(name: str, fn: BackendFn, refuses: Refusal = _accepts_everything,
                     prepare: Callable[[torch.Tensor, AttentionGraph], None] = _ready) -> None:
    """Register ``fn`` under ``name`` (see ``Backend`` for the three callables)."""
    _BACKENDS[name] = Backend(name, fn, refuses, prepare)


def _load_optional_backends() -> None:
    """Import the optional backends once; a failure is kept, and warned about unless it is an
    optional third-party dependency that is simply not installed."""
    global _OPTIONAL_IMPORT_TRIED
    if _OPTIONAL_IMPORT_TRIED:
        return
    _OPTIONAL_IMPORT_TRIED = True
    for name, module in OPTIONAL_BACKENDS.items():  # each registers itself
        try:
            importlib.import_module(module)
        except ImportError as error:
            _IMPORT_ERRORS[name] = f"{type(error).__name__}: {error}"
            missing = getattr(error, "name", None) or ""
            if not isinstance(error, ModuleNotFoundError) or missing.startswith("fairseq_plugins"):
                warnings.warn(f"graph attention backend {name!r} failed to import ({_IMPORT_ERRORS[name]})",
                              RuntimeWarning, stacklevel=3)


def backend_import_errors() -> Dict[str, str]:
    """Backends whose module could not be imported, with the error (e.g. no Triton)."""
    _load_optional_backends()
    return dict(_IMPORT_ERRORS)


def get_backend(name: str) -> Backend:
    """The registered backend ``name``; a clear error when it is unknown or did not import."""
    _load_optional_backends()
    if name in _BACKENDS:
        return _BACKENDS[name]
    if name in _IMPORT_ERRORS:
        raise ValueError(f"graph attention backend {name!r} could not be imported: {_IMPORT_ERRORS[name]}")
    raise ValueError(f"graph attention backend {name!r} is not registered (available: {sorted(_BACKENDS)})")


def graph_attention(
    query, key, value, graph: AttentionGraph, rel_key=None, key_padding_mask=None,
    dropout_p: float = 0.0, scale: Optional[float] = None, backend: str = "auto",
) -> torch.Tensor:
    """query: [B, H, N, D]; key, value: [B, H, M, D] (same dtype/device); graph: an
    ``AttentionGraph`` of N query rows over M keys (M = N but for a decoding step's graph).

    rel_key: [graph.num_edge_types, D] or None; one learned vector per edge type, shared by
        heads, added to keys: score(u, v) = scale * q_u . (k_v + rel_key[type(u, v)]); scale
        defaults to D ** -0.5.
    key_padding_mask: [B, M] bool or None, True = node absent in that sentence (padding or a
        span that covers only padding): never attended to.
    A query row with no present in-neighbour returns zeros (and zero gradients).
    dropout_p: attention-probability dropout (applied after softmax, like fairseq).
    Under autocast, float32 query/key/value are computed in autocast's dtype (``precision``);
    rel_key keeps its dtype, and so does its gradient.
    backend: "auto" or a registered name ("torch", "cpu", "cuda", "flex", ...); "auto" = the
        first of ``AUTO_PREFERENCE`` (CUDA) or ``CPU_AUTO_PREFERENCE`` (CPU) that accepts
        the inputs and passed its self-check, else "torch".
    Returns [B, H, N, D].
    """
    query, key, value = autocast_inputs(query, key, value)
    _check_inputs(query, key, value, graph, rel_key, key_padding_mask, dropout_p)
    if scale is None:
        scale = query.size(-1) ** -0.5
    name = resolve_backend(backend, query.device, query.dtype, query.size(-1), graph, float(dropout_p),
                           None if rel_key is None else rel_key.dtype)
    with autocast_off(query.device):
        return _BACKENDS[name].fn(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale)


@torch.compiler.assume_constant_result
def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                    graph: AttentionGraph, dropout_p: float, rel_dtype: Optional[torch.dtype]) -> str:
    """The name of the backend that runs queries of this device, dtype and head dim over
    ``graph``, ready to run: "auto" resolved (self-checks included), a refusal raised,
    ``prepare`` done. (Limits on the batch size, which may be symbolic under
    ``torch.compile``, are the backend function's to check.)

    Plain Python over the inputs' metadata, so that ``torch.compile`` evaluates it once
    while tracing (imports, builds and self-checks are not traced) and keeps its answer as a
    constant of the compiled graph."""
    # what the backends look at: one sentence and head of the query's kind
    query = torch.empty((), dtype=dtype, device=device).expand(1, 1, graph.num_nodes, head_dim)
    if backend == "auto":
        backend = auto_backend(query, graph, dropout_p, rel_dtype)
    entry = get_backend(backend)
    reason = entry.refuses(query, graph, dropout_p)
    if reason is not None:
        raise RuntimeError(f"graph attention backend {backend!r} cannot run these inputs: {reason}")
    entry.prepare(query, graph)
    return backend


def _check_inputs(query, key, value, graph, rel_key, key_padding_mask, dropout_p):
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4 \
            or query.shape[:2] != key.shape[:2] or query.size(-1) != key.size(-1):
        raise ValueError(f"query must be [B, H, N, D] and key/value [B, H, M, D]; got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if not query.dtype == key.dtype == value.dtype or not query.is_floating_point():
        raise ValueError(f"query, key and value must have one floating dtype, got "
                         f"{query.dtype}, {key.dtype}, {value.dtype}")
    if not query.device == key.device == value.device:
        raise ValueError(f"query, key and value must be on one device, got "
                         f"{query.device}, {key.device}, {value.device}")
    if query.size(2) != graph.num_nodes or key.size(2) != graph.num_keys:
        raise ValueError(f"inputs have {query.size(2)} query and {key.size(2)} key nodes, the graph "
                         f"{graph.num_nodes} query nodes over {graph.num_keys} keys")
    if rel_key is not None and (rel_key.shape != (graph.num_edge_types, query.size(-1))
                                or not rel_key.is_floating_point() or rel_key.device != query.device):
        raise ValueError(f"rel_key must be a floating [{graph.num_edge_types}, {query.size(-1)}] tensor "
                         f"on {query.device}, got {rel_key.dtype} {tuple(rel_key.shape)} on {rel_key.device}")
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool
        or key_padding_mask.shape != (query.size(0), graph.num_keys)
    ):
        raise ValueError("key_padding_mask must be a bool [B, M] tensor")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def wants_fast_backend(query: torch.Tensor) -> bool:
    """Whether "auto" tries the GPU backends (``AUTO_PREFERENCE``) for these tensors: CUDA ones.

    Module-level so that tests can stand a CPU tensor in for a CUDA one."""
    return query.is_cuda


def auto_backend(query: torch.Tensor, graph: AttentionGraph, dropout_p: float = 0.0,
                 rel_dtype: Optional[torch.dtype] = None) -> str:
    """The backend ``backend="auto"`` uses for these inputs (see the module docstring)."""
    _load_optional_backends()
    if wants_fast_backend(query):
        candidates = AUTO_PREFERENCE
    elif query.device.type == "cpu":
        candidates = CPU_AUTO_PREFERENCE
    else:
        candidates = ()
    for name in candidates:
        entry = _BACKENDS.get(name)
        if entry is not None and entry.refuses(query, graph, dropout_p) is None \
                and passes_self_check(name, query, rel_dtype):
            return name
    return "torch"


def passes_self_check(name: str, query: torch.Tensor, rel_dtype: Optional[torch.dtype] = None) -> bool:
    """Backend ``name`` against the torch backend on ``query``'s device, dtype and head dim
    (and relative keys of ``rel_dtype``, default the query's: float32 ones under autocast);
    run once per process (after ``prepare``, whose failure fails the check), with one warning
    naming the backend and the error on failure."""
    rel_dtype = rel_dtype or query.dtype
    key = (name, str(query.device), query.dtype, query.size(-1), rel_dtype)
    if key not in _SELF_CHECKS:
        try:
            _BACKENDS[name].prepare(query, SELF_CHECK_GRAPH())
            with torch.inference_mode(False), torch.enable_grad():  # whatever the caller runs in
                self_check(_BACKENDS[name].fn, query.device, query.dtype, query.size(-1), rel_dtype)
            _SELF_CHECKS[key] = None
        except Exception as error:  # any failure means: do not trust it here
            _SELF_CHECKS[key] = f"{type(error).__name__}: {error}"
            warnings.warn(f"graph attention backend {name!r} failed its self-check on "
                          f"{query.device} / {query.dtype} / head dim {query.size(-1)} and "
                          f"is not used there ({_SELF_CHECKS[key]}); using the next fast "
                          f"backend, else 'torch'", RuntimeWarning, stacklevel=3)
    return _SELF_CHECKS[key] is None


def self_check(fn: BackendFn, device, dtype, head_dim: int, rel_dtype: Optional[torch.dtype] = None) -> None:
    """Raise unless ``fn`` matches the torch backend (float64, CPU) on a BPT graph of 24 tokens
    (k = 2, 2 sentences, one padded to 11 tokens, 2 heads, relative keys of ``rel_dtype``,
    default ``dtype``): output and the gradients of query, key, value and relative keys, each
    in its input's dtype. Runs ``fn`` as the op does, with autocast off."""
    rel_dtype = rel_dtype or dtype
    graph = SELF_CHECK_GRAPH()
    gen = torch.Generator().manual_seed(0)
    shape = (2, 2, graph.num_nodes, head_dim)
    leaves = [torch.randn(shape, generator=gen) for _ in range(3)]
    leaves.append(0.5 * torch.randn(graph.num_edge_types, head_dim, generator=gen))
    grad_out = torch.randn(shape, generator=gen)
    absent = ~node_present(torch.tensor([24, 11]), 24)
    reference_fn = _BACKENDS["torch"].fn

    def outputs(backend_fn, tensors, mask, grad):
        tensors = [t.detach().requires_grad_() for t in tensors]
        with autocast_off(grad.device):
            out = backend_fn(*tensors[:3], graph, tensors[3], mask, 0.0, head_dim ** -0.5)
            out.backward(grad.to(out.dtype))
        return [out.detach()] + [t.grad for t in tensors]

    expected = outputs(reference_fn, [t.double() for t in leaves], absent, grad_out.double())
    inputs = [t.to(device, dtype) for t in leaves[:3]] + [leaves[3].to(device, rel_dtype)]
    actual = outputs(fn, inputs, absent.to(device), grad_out.to(device, dtype))
    dtypes = (dtype,) * 4 + (rel_dtype,)
    for name, a, e, want in zip(("output", "d query", "d key", "d value", "d rel_key"), actual, expected, dtypes):
        if a is None or a.shape != e.shape or a.dtype != want:
            raise RuntimeError(f"{name}: got {None if a is None else (a.dtype, tuple(a.shape))}")
        error = (a.double().cpu() - e).abs().max().item()
        tolerance = SELF_CHECK_TOLERANCE.get(dtype, SELF_CHECK_TOLERANCE[torch.float32])
        if not error <= tolerance * max(1.0, e.abs().max().item()):
            raise RuntimeError(f"{name} differs from the torch backend by {error:.3g}")
