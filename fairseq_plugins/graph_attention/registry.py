"""``graph_attention``: sparse multi-head attention over an explicit graph, and its backends.

One op computes for every query node u

    out_u = sum_{v in in(u), v present} softmax_v(scale * q_u . (k_v + rel_key[type(u, v)])) v_v

where ``in(u)`` is row u of a CSR adjacency (``AttentionGraph``). The graph is shared by all
sentences of a batch; sentences differ only through ``key_padding_mask``.

A ``Dispatcher`` owns the backends (``Backend``, looked up by name), their import errors,
the self-check memo and the autotuner; ``DEFAULT`` is the one the op uses, and tests build
their own. Each backend module defines ``BACKEND``; a dispatcher imports the modules of
``BACKEND_MODULES`` on first use (``BACKEND_NAMES``: the names every command line offers).
One whose module cannot be imported is reported: its error is kept (``import_errors``),
named when the backend is asked for, and warned about unless only an optional dependency
(Triton) is missing. A backend says why it cannot run some inputs (``refuses``, a pure check
of devices, dtypes, shapes and limits) apart from getting ready (``prepare``: build or load
its kernels), which happens only when it is about to be used. What every backend would
otherwise do alike is done once, where the op calls it (``Backend.__call__``): an edgeless
graph gives zeros, and the dropout seed is drawn (``dropout_seed``).

``backend="auto"`` (unless ``BACKEND_ENV`` names a backend) trusts a fast backend only
after it has checked itself: on the first call for a device, dtype and head dim, a backend
that accepts the inputs gets ready and computes a padded BPT graph forward and backward,
compared with the torch backend (remembered by the dispatcher); one that fails is named in a
single warning and never used there. On a GPU, the backends of ``AUTO_CANDIDATES`` that
pass are timed on the call's graph, forward and backward, once per ``autotune.TuningKey``
(device, dtype, head dim, size bucket, dropout on/off), and the fastest is used; the timings
are kept in memory and on disk (``autotune``). On CPU the first of ``CPU_AUTO_PREFERENCE``
that passes is used. When "auto" ends on the torch backend it logs once per device and
dtype why each fast one was skipped.
"""

import functools
import importlib
import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

import fairseq_plugins.graph_attention.autotune as autotune
from fairseq_plugins.graph_attention.precision import autocast_inputs, autocast_off
from fairseq_plugins.graphs.attention_graph import AttentionGraph
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present

logger = logging.getLogger(__name__)

# backend name -> the module that defines it (``BACKEND``); "torch" is the exact reference
BACKEND_MODULES = {
    "torch": "fairseq_plugins.graph_attention.torch_backend",
    "cpu": "fairseq_plugins.graph_attention.cpu_backend",
    "triton": "fairseq_plugins.graph_attention.triton_backend",
    "cuda": "fairseq_plugins.graph_attention.cuda_backend",
    "flex": "fairseq_plugins.graph_attention.flex_backend",
}
BACKEND_NAMES = tuple(BACKEND_MODULES)
# the backends "auto" times on a CUDA tensor; one that is not registered, refuses the inputs
# or fails its self-check is skipped (the torch backend is the reference and is not checked)
AUTO_CANDIDATES = ("triton", "cuda", "flex", "torch")
# the backends whose GPU kernels are this project's own (what compute-sanitizer checks)
OWN_GPU_KERNELS = ("triton", "cuda")
# set to a backend name, it replaces backend="auto" (an explicit backend= still wins)
BACKEND_ENV = "FAIRSEQ_PLUGINS_GRAPH_ATTENTION_BACKEND"
# fast backends "auto" may use on a CPU tensor, best first, untimed: the fused "cpu" kernel is
# 2-7x faster than the torch backend at every graph size measured, from sentences of 16
# tokens to documents of 8192 (benchmarks/graph_attention.md), and the only other candidate
# ("flex") has no backward on CPU
CPU_AUTO_PREFERENCE: Tuple[str, ...] = ("cpu",)
# the device types on which "auto" times ``AUTO_CANDIDATES``
TIMED_DEVICES = ("cuda",)
# the self-check's graph: long enough that every fast backend splits work as it does in
# training (the root span's row reads every token: more key tiles than one Triton program
# walks, 16 x 32 at fp16, and more edges than one CUDA warp's piece, 256), k = 1 to stay small
SELF_CHECK_TOKENS = 520
SELF_CHECK_GRAPH = functools.partial(bpt_graph, SELF_CHECK_TOKENS, 1)
SELF_CHECK_DROPOUT = 0.25
# allowed max |backend - torch| relative to the reference's magnitude, per dtype
SELF_CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# the workload "auto" times, per graph: about this many nodes over the batch (a batch of
# 4096 tokens is about 8192 nodes), ``TIMING_HEADS`` heads
TIMING_BATCH_NODES = 8192
TIMING_HEADS = 8

BackendFn = Callable[..., torch.Tensor]
# (query, graph, dropout_p) -> why the backend cannot run these inputs, or None
Refusal = Callable[[torch.Tensor, AttentionGraph, float], Optional[str]]


def _accepts_everything(query, graph, dropout_p) -> Optional[str]:
    return None


def _ready(query, graph) -> None:
    return None


def dropout_seed(device, dropout_p: float) -> Optional[torch.Tensor]:
    """The dropout stream of one call: int64 [2] (seed, offset), each below 2**31, drawn on
    ``device`` from torch's generator there (``torch.manual_seed`` reproduces it); None
    without dropout (nothing drawn). A device op, not a host integer: a captured CUDA graph
    draws anew on every replay, a compiled graph on every call, and the backward reads the
    saved tensor, hence the forward's mask."""
    if dropout_p > 0:
        return torch.randint(2**31 - 1, (2,), dtype=torch.int64, device=device)
    return None


@dataclass(frozen=True)
class Backend:
    """An implementation of the op.

    ``fn(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale)`` (with a
    ``seed`` keyword when ``seeded``: ``dropout_seed``'s tensor); ``refuses(query, graph,
    dropout_p)``: the reason it cannot run these inputs, or None (cheap and side-effect
    free: it never builds anything); ``prepare(query, graph)``: build or load what ``fn``
    needs for such a query (kernels, the graph's derived data), raising when that is
    impossible here; called before each use, outside any ``torch.compile`` trace (so ``fn``
    only reads what it prepared), and cheap once done. ``fn`` never sees an edgeless graph."""

    name: str
    fn: BackendFn
    refuses: Refusal = _accepts_everything
    prepare: Callable[[torch.Tensor, AttentionGraph], None] = _ready
    seeded: bool = False  # draws its dropout mask from a seed tensor, not torch's generator

    def __call__(self, query, key, value, graph: AttentionGraph, rel_key, key_padding_mask,
                 dropout_p: float, scale: float) -> torch.Tensor:
        """``fn`` as the op runs it: zeros for a graph without edges (no row has a key), the
        dropout seed drawn here for a seeded backend."""
        if graph.num_edges == 0:
            return torch.zeros_like(query)
        if self.seeded:
            return self.fn(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale,
                           seed=dropout_seed(query.device, dropout_p))
        return self.fn(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale)


def release(version: str) -> Tuple[int, ...]:
    """(major, minor) of a version string such as ``2.11.0+cu130``."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:2])


# The first torch whose torch.compile passes the graph (a frozen dataclass) to
# ``resolve_backend``: 2.11's Dynamo fails on it ("can't reconstruct arbitrary frozen dataclass
# instances") in every compiled model, 2.13's traces it. Before it the op runs outside the
# compiled graph (a graph break); fullgraph=True is refused with this reason.
TRACEABLE_FROM = (2, 13)


class Dispatcher:
    """The backends of one process (or one test) and what "auto" learned about them.

    ``modules``: backend name -> module defining ``BACKEND``, imported on first use;
    ``register`` adds or replaces one. ``auto_candidates``, ``cpu_preference``,
    ``timed_devices`` and ``timing_batch_nodes``: see the module's constants of those names;
    ``autotuner``: where the timings of "auto" are kept (default: one over the plugin's
    cache)."""

    def __init__(self, modules: Mapping[str, str] = BACKEND_MODULES,
                 auto_candidates: Sequence[str] = AUTO_CANDIDATES,
                 cpu_preference: Sequence[str] = CPU_AUTO_PREFERENCE,
                 timed_devices: Sequence[str] = TIMED_DEVICES,
                 autotuner: Optional[autotune.Autotuner] = None,
                 timing_batch_nodes: int = TIMING_BATCH_NODES):
        self.modules = dict(modules)
        self.auto_candidates, self.cpu_preference = tuple(auto_candidates), tuple(cpu_preference)
        self.timed_devices, self.timing_batch_nodes = tuple(timed_devices), timing_batch_nodes
        self.autotuner = autotune.Autotuner() if autotuner is None else autotuner
        self._backends: Dict[str, Backend] = {}
        self._import_errors: Dict[str, str] = {}  # backend name -> why its module did not import
        self._imported = False
        # (backend, device, dtype, head dim, rel_key dtype) -> None when the self-check passed, else the error
        self.self_checks: Dict[Tuple[str, str, torch.dtype, int, torch.dtype], Optional[str]] = {}
        self._fallbacks_logged = set()  # (device, dtype) whose torch fallback was logged

    def _import(self) -> None:
        """Import the backends' modules once; a failure is kept, and warned about unless it is
        an optional third-party dependency that is simply not installed."""
        if self._imported:
            return
        self._imported = True
        for name, module in self.modules.items():
            try:
                self._backends.setdefault(name, importlib.import_module(module).BACKEND)
            except ImportError as error:
                self._import_errors[name] = f"{type(error).__name__}: {error}"
                missing = getattr(error, "name", None) or ""
                if not isinstance(error, ModuleNotFoundError) or missing.startswith("fairseq_plugins"):
                    warnings.warn(f"graph attention backend {name!r} failed to import "
                                  f"({self._import_errors[name]})", RuntimeWarning, stacklevel=4)

    @property
    def backends(self) -> Dict[str, Backend]:
        """The registered backends by name (the modules imported first)."""
        self._import()
        return self._backends

    def import_errors(self) -> Dict[str, str]:
        """Backends whose module could not be imported, with the error (e.g. no Triton)."""
        self._import()
        return dict(self._import_errors)

    def register(self, backend: Backend) -> Backend:
        """Add ``backend`` under its name (replacing one of that name); returns it."""
        self.backends[backend.name] = backend
        return backend

    def get(self, name: str) -> Backend:
        """The registered backend ``name``; a clear error when it is unknown or did not import."""
        if name in self.backends:
            return self._backends[name]
        if name in self._import_errors:
            raise ValueError(f"graph attention backend {name!r} could not be imported: {self._import_errors[name]}")
        raise ValueError(f"graph attention backend {name!r} is not registered (available: {sorted(self._backends)})")

    def refuses(self, name: str, query: torch.Tensor, graph: AttentionGraph, dropout_p: float = 0.0) -> Optional[str]:
        """Why backend ``name`` cannot run such a query over ``graph`` here (not imported,
        not registered, or its own ``refuses``), or None. Builds nothing."""
        try:
            return self.get(name).refuses(query, graph, dropout_p)
        except ValueError as error:
            return str(error)

    def graph_attention(self, query, key, value, graph: AttentionGraph, rel_key=None, key_padding_mask=None,
                        dropout_p: float = 0.0, scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
        """The op through this dispatcher's backends (see the module-level ``graph_attention``)."""
        if torch.compiler.is_compiling() and release(torch.__version__) < TRACEABLE_FROM:
            raise RuntimeError(f"torch.compile traces graph_attention from torch {'.'.join(map(str, TRACEABLE_FROM))} "
                               f"on; with torch {torch.__version__} it runs outside the compiled graph")
        query, key, value = autocast_inputs(query, key, value)
        _check_inputs(query, key, value, graph, rel_key, key_padding_mask, dropout_p)
        if scale is None:
            scale = query.size(-1) ** -0.5
        name = resolve_backend(self, backend, query.device, query.dtype, query.size(-1), graph, float(dropout_p),
                               None if rel_key is None else rel_key.dtype)
        with autocast_off(query.device):
            return self._backends[name](query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale)

    def resolve(self, backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                graph: AttentionGraph, dropout_p: float, rel_dtype: Optional[torch.dtype]) -> str:
        """The name of the backend that runs queries of this device, dtype and head dim over
        ``graph``, ready to run: "auto" resolved (self-checks included), a refusal raised,
        ``prepare`` done. (Limits on the batch size, which may be symbolic under
        ``torch.compile``, are the backend function's to check.)"""
        # what the backends look at: one sentence and head of the query's kind
        query = torch.empty((), dtype=dtype, device=device).expand(1, 1, graph.num_nodes, head_dim)
        named_by = ""
        if backend == "auto" and os.environ.get(BACKEND_ENV, "auto") != "auto":
            backend, named_by = os.environ[BACKEND_ENV], f" (named by {BACKEND_ENV})"
        if backend == "auto":
            backend = self.auto(query, graph, dropout_p, rel_dtype)
        try:
            entry = self.get(backend)
        except ValueError as error:
            raise ValueError(f"{error}{named_by}") from None
        reason = entry.refuses(query, graph, dropout_p)
        if reason is not None:
            raise RuntimeError(f"graph attention backend {backend!r}{named_by} cannot run these inputs: {reason}")
        entry.prepare(query, graph)
        return backend

    def auto(self, query: torch.Tensor, graph: AttentionGraph, dropout_p: float = 0.0,
             rel_dtype: Optional[torch.dtype] = None) -> str:
        """The backend ``backend="auto"`` uses for these inputs (see the module docstring); the
        environment's ``BACKEND_ENV`` is not read here (``resolve`` does)."""
        skipped: Dict[str, str] = {}  # fast backend -> why it is not used
        if query.device.type not in self.timed_devices:
            for name in self.cpu_preference if query.device.type == "cpu" else ():
                skipped[name] = self.refuses(name, query, graph, dropout_p) or self._distrust(name, query, rel_dtype)
                if skipped[name] is None:
                    return name
            return self._fall_back(query, skipped)
        names = []
        for name in self.auto_candidates:
            reason = self.refuses(name, query, graph, dropout_p)
            if reason is None:
                names.append(name)
            else:
                skipped[name] = reason
        key = autotune.TuningKey(autotune.device_name(query.device), query.dtype, rel_dtype, query.size(-1),
                                 autotune.size_bucket(graph.num_nodes), dropout_p > 0)
        timing = self.autotuner.lookup(key)
        if timing is None or not timing.covers(names):
            untrusted = {name: self._distrust(name, query, rel_dtype) for name in names
                         if self._distrust(name, query, rel_dtype)}
            correct = [name for name in names if name not in untrusted]
            if len(correct) < 2:
                skipped.update(untrusted)
                return self._fall_back(query, skipped) if correct in ([], ["torch"]) else correct[0]
            make_run = functools.partial(self._timed_run, query=query, graph=graph, dropout_p=dropout_p,
                                         rel_dtype=rel_dtype)
            with torch.inference_mode(False), torch.enable_grad(), autocast_off(query.device), \
                    torch.random.fork_rng(devices=[query.device] if query.is_cuda else []):
                timing = self.autotuner.tune(key, correct, make_run, query.device, untrusted)
        for name in timing.fastest_first(names):  # a timing from disk: check the winner in this process
            skipped[name] = self._distrust(name, query, rel_dtype)
            if skipped[name] is None:
                if name != "torch":
                    return name
                skipped.update({other: f"timed slower: {timing.summary()}" for other in timing.times_ms})
                break
        skipped.update(timing.failed)
        return self._fall_back(query, skipped)

    def _distrust(self, name: str, query: torch.Tensor, rel_dtype: Optional[torch.dtype]) -> Optional[str]:
        """Why "auto" does not trust backend ``name`` here (its failed self-check), or None."""
        error = self.self_check_error(name, query, rel_dtype)
        return None if error is None else f"self-check: {error}"

    def _fall_back(self, query: torch.Tensor, skipped: Dict[str, str]) -> str:
        """"torch", logged once per device and dtype with why each fast backend was skipped."""
        seen = (str(query.device), query.dtype)
        if seen not in self._fallbacks_logged:
            self._fallbacks_logged.add(seen)
            reasons = "; ".join(f"{name}: {why}" for name, why in skipped.items() if name != "torch")
            logger.info("graph attention auto uses the torch backend on %s / %s (%s)", seen[0],
                        str(seen[1]).replace("torch.", ""), reasons or f"no fast backend runs on {query.device.type}")
        return "torch"

    def _timed_run(self, name: str, query: torch.Tensor, graph: AttentionGraph, dropout_p: float,
                   rel_dtype: Optional[torch.dtype]) -> autotune.Run:
        """One forward and backward of backend ``name`` on ``graph`` as training runs it (query,
        key, value, relative keys and a padding mask, ``timing_batch_nodes`` nodes over the
        batch), inputs built here so that the run times the op alone; called under the grad
        mode, autocast state and forked random state of the timing (``auto``)."""
        entry = self._backends[name]
        entry.prepare(query, graph)
        batch = max(1, round(self.timing_batch_nodes / graph.num_nodes))
        gen = torch.Generator().manual_seed(0)
        shape = (batch, TIMING_HEADS, graph.num_nodes, query.size(-1))
        q, k, v = (torch.randn(shape, generator=gen).to(query.device, query.dtype).requires_grad_() for _ in range(3))
        rel_key = None if rel_dtype is None else torch.randn(
            graph.num_edge_types, query.size(-1), generator=gen).to(query.device, rel_dtype).requires_grad_()
        mask = torch.zeros(batch, graph.num_keys, dtype=torch.bool, device=query.device)
        grad = torch.randn(shape, generator=gen).to(query.device, query.dtype)
        scale = query.size(-1) ** -0.5

        def run():
            for leaf in (q, k, v, rel_key):
                if leaf is not None:
                    leaf.grad = None
            entry(q, k, v, graph, rel_key, mask, dropout_p, scale).backward(grad)
        return run

    def self_check_error(self, name: str, query: torch.Tensor,
                         rel_dtype: Optional[torch.dtype] = None) -> Optional[str]:
        """None when backend ``name`` matches the torch backend on ``query``'s device, dtype
        and head dim (and relative keys of ``rel_dtype``, default the query's: float32 ones
        under autocast), else the error; run once per dispatcher (after ``prepare``, whose
        failure fails the check), with one warning naming the backend and the error on
        failure. The torch backend is the reference: never checked. A backend that refuses
        dropout is checked without it (it never runs it)."""
        if name == "torch":
            return None
        key = (name, str(query.device), query.dtype, query.size(-1), rel_dtype or query.dtype)
        if key not in self.self_checks:
            try:
                graph = SELF_CHECK_GRAPH()
                entry = self.get(name)
                check_query = query.new_empty(()).expand(1, 1, graph.num_nodes, query.size(-1))
                dropout = entry.refuses(check_query, graph, SELF_CHECK_DROPOUT) is None
                entry.prepare(query, graph)
                with torch.inference_mode(False), torch.enable_grad():  # whatever the caller runs in
                    self_check(entry, query.device, query.dtype, query.size(-1), key[-1], dropout,
                               reference=self.get("torch"))
                self.self_checks[key] = None
            except Exception as error:  # any failure means: do not trust it here
                self.self_checks[key] = f"{type(error).__name__}: {error}"
                warnings.warn(f"graph attention backend {name!r} failed its self-check on "
                              f"{query.device} / {query.dtype} / head dim {query.size(-1)} and "
                              f"is not used there ({self.self_checks[key]}); 'auto' uses another backend",
                              RuntimeWarning, stacklevel=4)
        return self.self_checks[key]


# the dispatcher of the op (``graph_attention``) and of ``register_backend``
DEFAULT = Dispatcher()


def register_backend(name: str, fn: BackendFn, refuses: Refusal = _accepts_everything,
                     prepare: Callable[[torch.Tensor, AttentionGraph], None] = _ready,
                     seeded: bool = False) -> None:
    """Register ``fn`` under ``name`` with the op's dispatcher (see ``Backend``)."""
    DEFAULT.register(Backend(name, fn, refuses, prepare, seeded))


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
    backend: "auto" or a registered name (``BACKEND_NAMES``); "auto" = the backend named by
        the environment variable ``BACKEND_ENV`` if set, else on CUDA the fastest of
        ``AUTO_CANDIDATES`` that accepts the inputs and passed its self-check (timed once
        per ``autotune.TuningKey``), on CPU the first such of ``CPU_AUTO_PREFERENCE``, else
        "torch". Runs through ``DEFAULT``.
    Returns [B, H, N, D].
    """
    return DEFAULT.graph_attention(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale, backend)


@torch.compiler.assume_constant_result
def resolve_backend(dispatcher: Dispatcher, backend: str, device: torch.device, dtype: torch.dtype,
                    head_dim: int, graph: AttentionGraph, dropout_p: float,
                    rel_dtype: Optional[torch.dtype]) -> str:
    """``dispatcher.resolve``, as plain Python over the inputs' metadata, so that
    ``torch.compile`` evaluates it once while tracing (imports, builds and self-checks are
    not traced) and keeps its answer as a constant of the compiled graph."""
    return dispatcher.resolve(backend, device, dtype, head_dim, graph, dropout_p, rel_dtype)


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


def self_check(fn: BackendFn, device, dtype, head_dim: int, rel_dtype: Optional[torch.dtype] = None,
               dropout: bool = True, reference: Optional[BackendFn] = None) -> None:
    """Raise unless ``fn`` computes what training runs, on ``SELF_CHECK_GRAPH`` (a BPT graph
    long enough that every fast backend splits work: see ``SELF_CHECK_TOKENS``), two
    sentences, one padded, 2 heads, relative keys of ``rel_dtype`` (default ``dtype``), each
    result in its input's dtype, ``fn`` run as the op runs it (autocast off; a ``Backend``
    draws its seed), against ``reference`` (default: the op's torch backend):

    * without dropout: output and the gradients of query, key, value and relative keys
      match the torch backend in float64;
    * with dropout ``SELF_CHECK_DROPOUT`` (unless ``dropout`` is False): a seed (``torch.manual_seed``) gives the same
      output again; the backward applies the forward's mask (<out, dO> = <V, dV>, since
      the output is linear in V for a fixed mask); the kept probability mass per row is
      about 1 (the rate and the 1 / (1 - p) scaling); and for float32/float64 the
      gradients of query, key and relative keys match a central difference of the output
      under the same seed.

    Draws from torch's generators without changing their state for the caller."""
    rel_dtype = rel_dtype or dtype
    device = torch.device(device)
    graph = SELF_CHECK_GRAPH()
    gen = torch.Generator().manual_seed(0)
    shape = (2, 2, graph.num_nodes, head_dim)
    leaves = [torch.randn(shape, generator=gen) for _ in range(3)]
    leaves.append(0.5 * torch.randn(graph.num_edge_types, head_dim, generator=gen))
    grad_out = torch.randn(shape, generator=gen)
    absent = ~node_present(torch.tensor([SELF_CHECK_TOKENS, SELF_CHECK_TOKENS // 2 + 3]), SELF_CHECK_TOKENS)
    reference_fn = reference or DEFAULT.get("torch")
    dtypes = (dtype,) * 3 + (rel_dtype,)

    def run(backend_fn, tensors, grad, dropout_p=0.0, seed=0):
        """(output, gradients of the four inputs or None without ``grad``) under ``seed``;
        the padding mask on the tensors' device."""
        mask = absent.to(tensors[0].device)
        tensors = [t.detach().requires_grad_(grad is not None) for t in tensors]
        torch.manual_seed(seed)
        with autocast_off(device):
            out = backend_fn(*tensors[:3], graph, tensors[3], mask, dropout_p, head_dim ** -0.5)
            if grad is not None:
                out.backward(grad.to(out.dtype))
        return out.detach(), [t.grad for t in tensors]

    def check(name, actual, expected, want_dtype, tolerance):
        if actual is None or actual.shape != expected.shape or actual.dtype != want_dtype:
            raise RuntimeError(f"{name}: got {None if actual is None else (actual.dtype, tuple(actual.shape))}")
        error = (actual.double().cpu() - expected).abs().max().item()
        if not error <= tolerance * max(1.0, expected.abs().max().item()):
            raise RuntimeError(f"{name} differs from the torch backend by {error:.3g}")

    tolerance = SELF_CHECK_TOLERANCE.get(dtype, SELF_CHECK_TOLERANCE[torch.float32])
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        expected = run(reference_fn, [t.double() for t in leaves], grad_out.double())
        inputs = [t.to(device, want) for t, want in zip(leaves, dtypes)]
        grad = grad_out.to(device, dtype)
        out, grads = run(fn, inputs, grad)
        check("output", out, expected[0], dtype, tolerance)
        for name, a, e, want in zip(("d query", "d key", "d value", "d rel_key"), grads, expected[1], dtypes):
            check(name, a, e, want, tolerance)
        if dropout:
            _check_dropout(run, fn, inputs, grad, dtype, tolerance)


def _check_dropout(run, fn, inputs, grad, dtype, tolerance) -> None:
    """The dropout part of ``self_check`` (see there)."""
    p = SELF_CHECK_DROPOUT
    out, grads = run(fn, inputs, grad, p, seed=1)
    again, _ = run(fn, inputs, None, p, seed=1)
    if not torch.equal(out, again):
        raise RuntimeError("dropout: the same seed gave a different output")
    # <out, dO> = <V, dV>: the backward's mask is the forward's
    products = ((out.double() * grad.double()).sum().item(), (inputs[2].double() * grads[2].double()).sum().item())
    size = (out.double() * grad.double()).abs().sum().item()
    if not abs(products[0] - products[1]) <= tolerance * max(size, 1.0):
        raise RuntimeError(f"dropout: the backward's mask is not the forward's (<out, dO> = {products[0]:.6g}, "
                           f"<V, dV> = {products[1]:.6g})")
    # all-ones values: each row's kept probability mass, 1 on average (0 for rows without keys)
    ones = [inputs[0], inputs[1], torch.ones_like(inputs[2]), inputs[3]]
    kept = run(fn, ones, None, p, seed=2)[0][..., 0].double()
    has_key = run(fn, ones, None)[0][..., 0].double() > 0.5
    mean = kept[has_key].mean().item()
    if not abs(mean - 1.0) <= 0.05:
        raise RuntimeError(f"dropout: the kept probability mass per row averages {mean:.3g}, not 1")
    if dtype not in (torch.float32, torch.float64):
        return
    # d query, d key, d rel_key under dropout: a central difference along a random direction
    gen = torch.Generator().manual_seed(3)
    direction = [torch.randn(t.shape, generator=gen).to(t) for t in inputs]
    direction[2] = torch.zeros_like(inputs[2])  # value's gradient is checked above
    step = 1e-3

    def loss(sign):
        moved = [t + sign * step * d for t, d in zip(inputs, direction)]
        return (run(fn, moved, None, p, seed=1)[0].double() * grad.double()).sum().item()

    numeric = (loss(1) - loss(-1)) / (2 * step)
    terms = [(g.double() * d.double()) for g, d in zip(grads, direction)]
    analytic = sum(t.sum().item() for t in terms)
    size = sum(t.abs().sum().item() for t in terms)
    if not abs(numeric - analytic) <= 1e-2 * max(size, 1.0):
        raise RuntimeError(f"dropout: gradients of query/key/rel_key ({analytic:.6g} along a direction) differ "
                           f"from the output's central difference ({numeric:.6g})")
