"""Sparse multi-head attention over an explicit graph, with pluggable backends.

One op, ``graph_attention``, computes for every query node u

    out_u = sum_{v in in(u), v present} softmax_v(scale * q_u . (k_v + rel_key[type(u, v)])) v_v

where ``in(u)`` is row u of a CSR adjacency (``AttentionGraph``). The graph is shared by all
sentences of a batch; sentences differ only through ``key_padding_mask``.

Backends are looked up by name (``register_backend``). The built-in ``"torch"`` backend has three
exact implementations:

* ``dense_graph_attention``: graphs of at most ``DENSE_MAX_NODES`` nodes (short sentences);
  the full [N, N] score matrix with -inf off the graph, one fused SDPA call. O(N^2), but a few
  large kernels beat the other paths' many small ones at this size.
* ``csr_attention``: any graph; gathers one key/value per edge and does a segment softmax with
  scatter ops. Memory is linear in the number of edges (times the head dim).
* ``tree_block_attention`` (module ``graph_attention_tree``): graphs laid out over a
  binary-partition tree (``graph.tree`` is set: tokens, then levels 1, 2, ...). Queries are
  grouped (tokens in runs of 32; spans in tiers of levels, block by block) so that the keys a
  group reads at each level form a narrow band of that level; the bands of all levels side
  by side are the group's score columns, one batched GEMM per product and no per-edge
  gather. It runs in cache-sized chunks with a hand-written backward: on CPU the op is bound
  by memory traffic. This is the path for every sentence longer than a few dozen tokens.

The CUDA backend lives in ``graph_attention_cuda`` (imported lazily) and registers itself as
``"cuda"``; it reads the int32 CSR and the transposed CSR cached on the graph.
"""

import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from fairseq_plugins.modules.graph_attention_tree import tree_block_attention


@dataclass(frozen=True)
class TreeLayout:
    """Node layout of a graph built over a binary-partition tree, used by the fast path.

    Nodes are laid out as ``num_tokens`` token nodes, then the nodes of level 1, level 2, ...;
    level j node m covers tokens [m * 2^j, min((m + 1) * 2^j, num_tokens)). The edges may be
    anything: the fast path is exact for every graph, and fast when each node's keys at a
    level lie close to the nodes it covers (as in BPT and SegTree).
    """

    num_tokens: int
    level_sizes: Tuple[int, ...]  # nodes per level, level 0 = tokens

    def __post_init__(self):
        expected = tuple(-(-self.num_tokens // (1 << j)) for j in range(len(self.level_sizes)))
        if self.num_tokens < 1 or self.level_sizes != expected:
            raise ValueError(f"a tree over {self.num_tokens} tokens has levels of "
                             f"ceil(num_tokens / 2^j) nodes {expected}, got {self.level_sizes}")

    @property
    def level_offsets(self) -> Tuple[int, ...]:
        offsets, total = [], 0
        for size in self.level_sizes:
            offsets.append(total)
            total += size
        return tuple(offsets)


@dataclass(frozen=True)
class AttentionGraph:
    """One sparse attention pattern over N nodes, shared by every sentence of a batch."""

    num_nodes: int
    indptr: torch.Tensor  # int64 [N + 1], CSR rows = query nodes
    indices: torch.Tensor  # int64 [E], key node of each edge (sorted within a row)
    edge_type: torch.Tensor  # int64 [E], row index into the relative-position table
    num_edge_types: int
    tree: Optional[TreeLayout] = None  # set by the tree builders; enables the fast path
    _cache: Dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self):
        n, e = self.num_nodes, self.indices.numel()
        if self.indptr.shape != (n + 1,) or int(self.indptr[-1]) != e:
            raise ValueError(f"indptr must have {n + 1} entries ending at {e} edges")
        if self.edge_type.shape != self.indices.shape:
            raise ValueError("edge_type and indices must have the same length")
        if e and (int(self.indices.min()) < 0 or int(self.indices.max()) >= n):
            raise ValueError("edge key index out of range")
        if e and (int(self.edge_type.min()) < 0 or int(self.edge_type.max()) >= self.num_edge_types):
            raise ValueError("edge type out of range")
        if self.tree is not None and sum(self.tree.level_sizes) != n:
            raise ValueError(f"the tree layout has {sum(self.tree.level_sizes)} nodes, the graph {n}")
        same_row = self.rows()[1:] == self.rows()[:-1]
        if bool((self.indices.diff() <= 0)[same_row].any()):
            raise ValueError("keys must be strictly increasing within each row")

    @property
    def num_edges(self) -> int:
        return self.indices.numel()

    def rows(self) -> torch.Tensor:
        """Query node of every edge (int64 [E])."""
        if "rows" not in self._cache:
            self._cache["rows"] = torch.repeat_interleave(
                torch.arange(self.num_nodes), self.indptr.diff()
            )
        return self._cache["rows"]

    def on(self, device, dtype=torch.int64) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr, indices, edge_type) on ``device`` as ``dtype``, cached (kernels use int32)."""
        key = ("csr", str(device), dtype)
        if key not in self._cache:
            self._cache[key] = tuple(
                t.to(device=device, dtype=dtype) for t in (self.indptr, self.indices, self.edge_type)
            )
        return self._cache[key]

    def transposed(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CSR by key node: (indptr [N + 1], query node [E], edge id [E]), int64 on CPU.

        Lets a backward pass accumulate dK/dV per key node without atomics."""
        if "transposed" not in self._cache:
            order = torch.sort(self.indices * self.num_nodes + self.rows()).indices
            counts = torch.bincount(self.indices, minlength=self.num_nodes)
            indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
            self._cache["transposed"] = (indptr, self.rows()[order], order)
        return self._cache["transposed"]


BackendFn = Callable[..., torch.Tensor]
_BACKENDS: Dict[str, Tuple[BackendFn, Callable[..., bool]]] = {}
_CUDA_IMPORT_TRIED = False


def register_backend(name: str, fn: BackendFn, is_available: Callable[..., bool]) -> None:
    """Register ``fn(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale)``.

    ``is_available(query)`` says whether the backend can run on these tensors."""
    _BACKENDS[name] = (fn, is_available)


def _load_optional_backends() -> None:
    global _CUDA_IMPORT_TRIED
    if not _CUDA_IMPORT_TRIED:
        _CUDA_IMPORT_TRIED = True
        for name in ("graph_attention_cuda", "graph_attention_flex"):  # each registers itself
            try:
                importlib.import_module(f"fairseq_plugins.modules.{name}")
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


DENSE_MAX_NODES = 96  # sentences up to 48 tokens: the measured CPU crossover (docs/bpt.md)


def _torch_backend(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale):
    if graph.num_nodes <= DENSE_MAX_NODES:
        return dense_graph_attention(query, key, value, graph, rel_key, key_padding_mask,
                                     dropout_p, scale)
    if graph.tree is not None:
        return tree_block_attention(query, key, value, graph, rel_key, key_padding_mask,
                                    dropout_p, scale)
    indptr, indices, edge_type = graph.on(query.device)
    return csr_attention(query, key, value, indptr, indices, edge_type, rel_key,
                         key_padding_mask, dropout_p, scale)


register_backend("torch", _torch_backend, lambda query: True)


def _dense_layout(graph: AttentionGraph, device, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """([N, N] additive mask, 0 on edges and -inf elsewhere; [N, N] edge type, 0 off the graph)."""
    key = ("dense", str(device), dtype)
    if key not in graph._cache:
        n = graph.num_nodes
        mask = torch.full((n, n), float("-inf"), dtype=dtype)
        mask[graph.rows(), graph.indices] = 0.0
        types = torch.zeros(n, n, dtype=torch.int64)
        types[graph.rows(), graph.indices] = graph.edge_type
        graph._cache[key] = (mask.to(device), types.to(device))
    return graph._cache[key]


def dense_graph_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                          dropout_p=0.0, scale=None) -> torch.Tensor:
    """Small graphs: all [N, N] scores with -inf off the graph, through one fused SDPA call.

    Wasteful in FLOPs but a handful of large kernels, which beats the structured paths' many
    small ones for the short sentences of MT. The relative term q . rel_key[type] is computed as
    q @ rel_key.T ([B, H, N, T], small) gathered by the cached [N, N] type index.
    """
    bsz, heads, num_nodes, dim = query.shape
    if scale is None:
        scale = dim ** -0.5
    mask, types = _dense_layout(graph, query.device, query.dtype)
    mask = mask.expand(bsz, 1, num_nodes, num_nodes)
    if key_padding_mask is not None:
        mask = mask.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    # rows with no present key: attend anywhere (finite), then zero the output below
    has_key = torch.isfinite(mask).any(-1, keepdim=True)  # [B, 1, N, 1]
    mask = mask.masked_fill(~has_key, 0.0)
    if rel_key is not None:
        q_rel = query @ rel_key.transpose(0, 1)  # [B, H, N, T]
        bias = torch.gather(q_rel, -1, types.expand(bsz, heads, num_nodes, num_nodes))
        mask = mask + bias * scale
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                         dropout_p=dropout_p if dropout_p > 0 else 0.0, scale=scale)
    return out * has_key.to(out.dtype)


def csr_attention(query, key, value, indptr, indices, edge_type, rel_key=None,
                  key_padding_mask=None, dropout_p=0.0, scale=None) -> torch.Tensor:
    """Generic path: query [B, H, R, D] rows of a CSR (indptr [R + 1]) over key/value [B, H, M, D].

    Also used for rectangular graphs (incremental decoding: R new nodes against M cached ones).
    """
    bsz, heads, num_rows, dim = query.shape
    if scale is None:
        scale = dim ** -0.5
    rows = torch.repeat_interleave(torch.arange(num_rows, device=query.device), indptr.diff(),
                                   output_size=indices.numel())
    scores = (query[:, :, rows] * key[:, :, indices]).sum(-1)  # [B, H, E]
    if rel_key is not None:
        scores = scores + (query @ rel_key.transpose(0, 1))[:, :, rows, edge_type]
    scores = scores * scale
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, indices].unsqueeze(1), float("-inf"))
    index = rows.expand(bsz, heads, -1)
    row_max = torch.full((bsz, heads, num_rows), float("-inf"), dtype=scores.dtype,
                         device=scores.device)
    row_max = row_max.scatter_reduce(2, index, scores.detach(), "amax")
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    exp = torch.exp(scores - row_max[:, :, rows])
    denom = exp.new_zeros(bsz, heads, num_rows).index_add(2, rows, exp)
    probs = exp / denom.clamp_min(torch.finfo(exp.dtype).tiny)[:, :, rows]
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    out = query.new_zeros(bsz, heads, num_rows, dim)
    return out.index_add(2, rows, probs.unsqueeze(-1) * value[:, :, indices])
