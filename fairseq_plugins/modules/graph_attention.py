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
* ``tree_block_attention``: graphs laid out over a binary-partition tree (``graph.tree`` is
  set: tokens, then levels 1, 2, ...). Queries are grouped (tokens by their ancestor at each
  level; spans by tiers of levels, block by block), and the keys a group reads at one level
  form a narrow band of that level, so each (group, level) pair is one small dense GEMM and no
  per-edge gather is needed. It runs in cache-sized chunks with a hand-written backward: on
  CPU the op is bound by memory traffic. This is the path for every sentence longer than a
  few dozen tokens.

The CUDA backend lives in ``graph_attention_cuda`` (imported lazily) and registers itself as
``"cuda"``; it reads the int32 CSR and the transposed CSR cached on the graph.
"""

import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


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


DENSE_MAX_NODES = 64  # measured crossover with the tree path on CPU, see docs/bpt.md


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


def _masked_softmax(scores: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax over ``dim`` that gives all-zero rows (and zero gradients) where nothing is valid."""
    scores = scores.masked_fill(~valid, float("-inf"))
    row_max = scores.amax(dim, keepdim=True).detach()
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    exp = torch.exp(scores - row_max)
    return exp / exp.sum(dim, keepdim=True).clamp_min(torch.finfo(exp.dtype).tiny)


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


# ---------------------------------------------------------------- structured fast path

@dataclass(frozen=True)
class _KeyBand:
    """Where the keys of one tree level sit in the score matrix of one query level."""

    offset: int  # first node of the key level in the graph
    size: int  # nodes in the key level
    full: bool  # every query reads the whole key level
    group: int  # band mode: consecutive queries that share one band of keys
    stride: int  # band mode: key nodes between the bands of consecutive groups
    left: int  # band mode: a band starts this many key nodes before its group's first one
    width: int  # score columns of this key level (band width, or the level size)
    column: int  # first score column


@dataclass(frozen=True)
class _QuerySet:
    """Query nodes handled together: row slots padded to whole groups, and their key bands."""

    nodes: torch.Tensor  # [padded] graph node of every row slot, -1 for an empty slot
    keys: Tuple[_KeyBand, ...]
    column_type: torch.Tensor  # [padded, W] edge type of every score column; num_edge_types = none
    no_edge: torch.Tensor  # [padded, W] bool
    has_edge: torch.Tensor  # [padded] bool; rows without one get a dummy column and zero output
    filled: torch.Tensor  # row slots that hold a node
    filled_nodes: torch.Tensor  # their nodes
    first_node: int  # when the filled slots are a prefix holding consecutive nodes: the first

    @property
    def padded(self) -> int:
        return self.nodes.numel()

    @property
    def num_columns(self) -> int:
        return self.column_type.size(1)


def _query_sets(tree: TreeLayout, min_group: int):
    """Row slots of the query sets: (nodes [padded], rows per unit, tokens per unit).

    Tokens form one set. Spans form tiers of log2(min_group) consecutive levels; a tier's
    spans are ordered block by block, where a block is the span of the tier's top level, so
    the spans under one block read the same tokens and a whole tier costs one pass over the
    keys instead of one pass per level."""
    offsets, sizes = tree.level_offsets, tree.level_sizes
    sets = [(torch.arange(sizes[0]), 1, 1)]
    per_tier = max(min_group.bit_length() - 1, 1)
    for first in range(1, len(sizes), per_tier):
        levels = range(first, min(first + per_tier, len(sizes)))
        top = levels[-1]
        blocks = -(-tree.num_tokens // (1 << top))
        slots = []
        for i in levels:  # per block: the 2^(top - i) spans of level i under it
            per_block = 1 << (top - i)
            index = torch.arange(blocks * per_block).view(blocks, per_block)
            slots.append(torch.where(index < sizes[i], offsets[i] + index, -1))
        slots = torch.cat(slots, 1)
        sets.append((slots.flatten(), slots.size(1), 1 << top))
    return sets


def _tree_plan(graph: AttentionGraph, min_group: int, max_group: int, device) -> Tuple[_QuerySet, ...]:
    """Place every edge in a score column of its query set (cached per graph and device).

    Against key level j, the rows of a set are grouped so that a group covers at least
    ``min_group`` tokens and one node of level j; the keys a group reads at that level then
    form one short band, and the pair (group, band) is one small GEMM. A key level whose band
    would be as wide as the level, or whose groups would exceed ``max_group`` rows, is read
    whole (one GEMM for all rows). Bands are measured from the edges, so any graph laid out
    as a tree is computed exactly; the tree's shape only decides how little is wasted."""
    key = ("tree_plan", min_group, max_group, str(device))
    if key in graph._cache:
        return graph._cache[key]
    tree = graph.tree
    offsets, sizes = tree.level_offsets, tree.level_sizes
    node_level = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    node_index = torch.arange(graph.num_nodes) - torch.tensor(offsets)[node_level]
    rows, cols, types = graph.rows(), graph.indices, graph.edge_type
    key_level, key_index = node_level[cols], node_index[cols]
    plan = []
    for nodes, unit_rows, unit_tokens in _query_sets(tree, min_group):
        slot_of = torch.full((graph.num_nodes,), -1)
        slot_of[nodes[nodes >= 0]] = torch.nonzero(nodes >= 0).flatten()
        edge_slot = slot_of[rows]
        specs = []  # (edges, offset, size, full, group, stride, left, width)
        for j, key_size in enumerate(sizes):
            at = (edge_slot >= 0) & (key_level == j)
            if not bool(at.any()):
                continue
            tokens = max(unit_tokens, 1 << j, min_group)  # tokens covered by one row group
            group, stride = unit_rows * tokens // unit_tokens, tokens >> j
            if group <= max_group:
                first = (edge_slot[at] // group) * stride
                left = int((first - key_index[at]).clamp_min(0).max())
                width = int((key_index[at] - first).max()) + left + 1
                if width < key_size:
                    specs.append((at, offsets[j], key_size, False, group, stride, left, width))
                    continue
            specs.append((at, offsets[j], key_size, True, 1, 1, 0, key_size))
        if not specs:
            continue  # no edges out of these nodes: their output stays zero
        step = max([spec[4] for spec in specs if not spec[3]], default=1)
        nodes = F.pad(nodes, (0, -(-nodes.numel() // step) * step - nodes.numel()), value=-1)
        column_type = torch.full((nodes.numel(), sum(spec[-1] for spec in specs)),
                                 graph.num_edge_types)
        has_edge = torch.zeros(nodes.numel(), dtype=torch.bool)
        bands, column = [], 0
        for at, offset, size, full, group, stride, left, width in specs:
            slot, k = edge_slot[at], key_index[at]
            start = 0 if full else (slot // group) * stride - left
            column_type[slot, column + k - start] = types[at]
            has_edge[slot] = True
            bands.append(_KeyBand(offset, size, full, group, stride, left, width, column))
            column += width
        column_type[~has_edge, 0] = 0  # keeps the softmax of edgeless and empty rows finite
        filled = torch.nonzero(nodes >= 0).flatten()
        prefix = torch.arange(filled.numel())
        consecutive = torch.equal(filled, prefix) and torch.equal(nodes[filled], nodes[0] + prefix)
        plan.append(_QuerySet(*(t.to(device) for t in (nodes,)), tuple(bands),
                              *(t.to(device) for t in (column_type, column_type == graph.num_edge_types,
                                                       has_edge, filled, nodes[filled])),
                              int(nodes[0]) if consecutive else -1))
    graph._cache[key] = tuple(plan)
    return graph._cache[key]


def _nodes(x: torch.Tensor, band: _KeyBand) -> torch.Tensor:
    """The [C, size, D] slice of a key level of [C, N, D] node states."""
    return x[:, band.offset:band.offset + band.size]


def _band(x: torch.Tensor, band: _KeyBand, groups: int) -> torch.Tensor:
    """[C, size, D] key-level nodes -> [C, groups, width, D]: the keys of every query group."""
    need = (groups - 1) * band.stride + band.width
    right = max(need - band.left - x.size(1), 0)
    if band.left or right:
        x = F.pad(x, (0, 0, band.left, right))
    if band.width == band.stride:  # bands side by side: a view
        return x[:, :need].reshape(x.size(0), groups, band.width, x.size(2))
    return x.unfold(1, band.width, band.stride)[:, :groups].transpose(-1, -2).contiguous()


def _unband(bands: torch.Tensor, band: _KeyBand) -> torch.Tensor:
    """Adjoint of ``_band``: [C, groups, width, D] -> [C, size, D], overlaps summed.

    The bands overlap in ceil(width / stride) shifted copies; adding those few shifted
    slices beats ``unfold``'s generic backward by far."""
    chunk, groups, width, dim = bands.shape
    shifts = -(-width // band.stride)
    if shifts * band.stride != width:
        bands = F.pad(bands, (0, 0, 0, shifts * band.stride - width))
    bands = bands.view(chunk, groups, shifts, band.stride, dim)
    if shifts == 1:
        out = bands.view(chunk, -1, dim)
    else:
        out = bands.new_zeros(chunk, groups + shifts - 1, band.stride, dim)
        for shift in range(shifts):
            out[:, shift:shift + groups] += bands[:, :, shift]
        out = out.view(chunk, -1, dim)
    end = band.left + band.size
    if out.size(1) < end:
        out = F.pad(out, (0, 0, 0, end - out.size(1)))
    return out[:, band.left:end]


def _for_each_band(queries: _QuerySet, matrix: torch.Tensor):
    """Yield (band, its columns of ``matrix`` [C, P, W], the number of query groups)."""
    for band in queries.keys:
        yield band, matrix[..., band.column:band.column + band.width], queries.padded // band.group


def _scores(qs, key, rel_key, absent, queries: _QuerySet) -> torch.Tensor:
    """[C, P, W] scores of the (scaled, padded) rows of a query set; -inf where no edge."""
    chunk, padded, dim = qs.shape
    parts = []
    for band in queries.keys:
        keys = _nodes(key, band)
        if band.full:
            parts.append(qs @ keys.transpose(-1, -2))
            continue
        groups = padded // band.group
        scores = qs.view(chunk, groups, band.group, dim) @ _band(keys, band, groups).transpose(-1, -2)
        parts.append(scores.view(chunk, padded, band.width))
    scores = torch.cat(parts, -1)
    if rel_key is not None:  # q . rel_key[type], and -inf off the graph, in one gather
        table = F.pad(qs @ rel_key.transpose(0, 1), (0, 1), value=float("-inf"))
        scores += torch.gather(table, -1, queries.column_type.expand(chunk, -1, -1))
    else:
        scores.masked_fill_(queries.no_edge, float("-inf"))
    if absent is not None:
        scores.masked_fill_(absent, float("-inf"))
    return scores


def _attend(out, probs, value, queries: _QuerySet) -> None:
    """out [C, P, D] += probs [C, P, W] @ (the value bands)."""
    dim = out.size(-1)
    for band, p, groups in _for_each_band(queries, probs):
        values = _nodes(value, band)
        if band.full:
            out.baddbmm_(p, values)
        else:
            out.view(-1, band.group, dim).baddbmm_(
                p.reshape(-1, band.group, band.width),
                _band(values, band, groups).reshape(-1, band.width, dim))


def _grad_probs_and_values(d_out, probs, value, grad_value, queries: _QuerySet) -> torch.Tensor:
    """Gradient of the probabilities ([C, P, W]); adds each key level's value gradient."""
    chunk, padded, dim = d_out.shape
    parts = []
    for band, p, groups in _for_each_band(queries, probs):
        values = _nodes(value, band)
        if band.full:
            parts.append(d_out @ values.transpose(-1, -2))
            _nodes(grad_value, band).baddbmm_(p.transpose(-1, -2), d_out)
            continue
        d_group = d_out.view(chunk, groups, band.group, dim)
        parts.append((d_group @ _band(values, band, groups).transpose(-1, -2))
                     .view(chunk, padded, band.width))
        p = p.reshape(chunk, groups, band.group, band.width)
        _nodes(grad_value, band).add_(_unband(p.transpose(-1, -2) @ d_group, band))
    return torch.cat(parts, -1)


def _grad_queries_and_keys(d_scores, qs, key, grad_key, queries: _QuerySet) -> torch.Tensor:
    """Gradient of the scaled queries ([C, P, D]); adds each key level's key gradient."""
    chunk, padded, dim = qs.shape
    d_qs = qs.new_zeros(qs.shape)
    for band, d, groups in _for_each_band(queries, d_scores):
        keys = _nodes(key, band)
        if band.full:
            d_qs.baddbmm_(d, keys)
            _nodes(grad_key, band).baddbmm_(d.transpose(-1, -2), qs)
            continue
        d = d.reshape(chunk, groups, band.group, band.width)
        d_qs.view(-1, band.group, dim).baddbmm_(
            d.reshape(-1, band.group, band.width), _band(keys, band, groups).reshape(-1, band.width, dim))
        q_group = qs.view(chunk, groups, band.group, dim)
        _nodes(grad_key, band).add_(_unband(d.transpose(-1, -2) @ q_group, band))
    return d_qs


def _presence(key_padding_mask, queries: _QuerySet):
    """([B, P, W] bool absent key of each column or None, [B, P] bool row has a key or None)."""
    if key_padding_mask is None:
        return None, (None if bool(queries.has_edge.all()) else queries.has_edge.unsqueeze(0))
    bsz, parts = key_padding_mask.size(0), []
    for band in queries.keys:
        absent = _nodes(key_padding_mask, band)
        if band.full:
            parts.append(absent[:, None, :].expand(bsz, queries.padded, band.size))
            continue
        groups = queries.padded // band.group
        need = (groups - 1) * band.stride + band.width
        absent = F.pad(absent, (band.left, max(need - band.left - band.size, 0)), value=True)
        bands = absent.unfold(1, band.width, band.stride)[:, :groups]
        parts.append(bands[:, :, None, :].expand(bsz, groups, band.group, band.width)
                     .reshape(bsz, queries.padded, band.width))
    absent = torch.cat(parts, -1)
    return absent, queries.has_edge & ~(absent | queries.no_edge).all(-1)


SCORES_PER_CHUNK = 1 << 20  # scores handled at once: 4 MB in fp32, sized to stay in cache


def _chunks(rows: int, queries: _QuerySet):
    step = max(1, SCORES_PER_CHUNK // (queries.padded * queries.num_columns))
    return [slice(start, start + step) for start in range(0, rows, step)]


def _gather_rows(x: torch.Tensor, queries: _QuerySet) -> torch.Tensor:
    """[C, N, D] node states -> [C, P, D] rows of the set (zeros in empty slots)."""
    count = queries.filled.numel()
    if queries.first_node >= 0:  # consecutive nodes (the tokens): a slice
        rows = x[:, queries.first_node:queries.first_node + count]
        return rows if count == queries.padded else F.pad(rows, (0, 0, 0, queries.padded - count))
    rows = x.new_zeros(x.size(0), queries.padded, x.size(2))
    return rows.index_copy_(1, queries.filled, x.index_select(1, queries.filled_nodes))


def _scatter_rows(out: torch.Tensor, rows: torch.Tensor, queries: _QuerySet) -> None:
    """The inverse of ``_gather_rows``: out[:, node of each filled slot] = that slot's row."""
    count = queries.filled.numel()
    if queries.first_node >= 0:
        out[:, queries.first_node:queries.first_node + count] = rows[:, :count]
    else:
        out.index_copy_(1, queries.filled_nodes, rows.index_select(1, queries.filled))


class _TreeAttention(torch.autograd.Function):
    """All queries of a tree graph, set by set: band GEMMs, one softmax per row, and a
    hand-written backward.

    Sentences x heads are processed in chunks of about ``SCORES_PER_CHUNK`` scores, so the
    score matrix, the key/value bands and the softmax stay in cache: on CPU this op is bound
    by memory traffic, not FLOPs. The backward reuses the saved probabilities and rebuilds
    the bands instead of letting autograd keep every intermediate."""

    @staticmethod
    def forward(ctx, query, key, value, rel_key, key_padding_mask, plan, scale, dropout_p):
        bsz, heads, num_nodes, dim = query.shape
        rows = bsz * heads
        # contiguous (sentence x head)-major rows: every chunk is one block of memory
        query, key, value = (x.reshape(rows, num_nodes, dim).contiguous()
                             for x in (query, key, value))
        # every node is a row of some set, unless a set without edges was left out of the plan
        covered = sum(queries.filled.numel() for queries in plan) == num_nodes
        out = (query.new_empty if covered else query.new_zeros)(rows, num_nodes, dim)
        saved = []
        for queries in plan:
            qs = _gather_rows(query, queries) * scale
            absent, has_key = _presence(key_padding_mask, queries)
            probs = qs.new_empty(rows, queries.padded, queries.num_columns)
            keep = (None if dropout_p == 0
                    else torch.empty_like(probs, dtype=torch.bool).bernoulli_(1 - dropout_p))
            set_out = qs.new_zeros(rows, queries.padded, dim)
            for chunk in _chunks(rows, queries):
                sentence = torch.arange(rows, device=qs.device)[chunk] // heads
                scores = _scores(qs[chunk], key[chunk], rel_key,
                                 None if absent is None else absent[sentence], queries)
                if has_key is not None:  # no present key: any finite row, its output is zeroed
                    scores.masked_fill_(~has_key[sentence % has_key.size(0)].unsqueeze(-1), 0.0)
                p = torch._softmax(scores, -1, False, out=probs[chunk])
                if keep is not None:
                    p = p * keep[chunk] / (1 - dropout_p)
                _attend(set_out[chunk], p, value[chunk], queries)
            if has_key is not None:
                set_out.view(-1, heads, queries.padded, dim).mul_(
                    has_key[:, None, :, None].to(set_out.dtype))
            _scatter_rows(out, set_out, queries)
            saved += [probs, keep, has_key]
        ctx.save_for_backward(query, key, value, rel_key, *saved)
        ctx.plan, ctx.scale, ctx.dropout_p, ctx.heads = plan, scale, dropout_p, heads
        return out.view(bsz, heads, num_nodes, dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        query, key, value, rel_key, *saved = ctx.saved_tensors
        scale, dropout_p = ctx.scale, ctx.dropout_p
        bsz, heads, num_nodes, dim = grad_out.shape
        rows = bsz * heads
        grad_out = grad_out.reshape(rows, num_nodes, dim)
        covered = sum(queries.filled.numel() for queries in ctx.plan) == num_nodes
        grad_query = (query.new_empty if covered else query.new_zeros)(rows, num_nodes, dim)
        grad_key, grad_value = (query.new_zeros(rows, num_nodes, dim) for _ in range(2))
        grad_rel = None if rel_key is None else torch.zeros_like(rel_key)
        for index, queries in enumerate(ctx.plan):
            probs, keep, has_key = saved[3 * index:3 * index + 3]
            qs = _gather_rows(query, queries) * scale
            d_out = _gather_rows(grad_out, queries)
            if has_key is not None:
                d_out = (d_out.view(-1, heads, queries.padded, dim)
                         * has_key[:, None, :, None].to(d_out.dtype)).view_as(d_out)
            d_query = qs.new_empty(qs.shape)
            for chunk in _chunks(rows, queries):
                p = probs[chunk]
                dropped = p if keep is None else p * keep[chunk] / (1 - dropout_p)
                d_probs = _grad_probs_and_values(d_out[chunk], dropped, value[chunk],
                                                 grad_value[chunk], queries)
                if keep is not None:
                    d_probs = d_probs * keep[chunk] / (1 - dropout_p)
                d_scores = torch._softmax_backward_data(d_probs, p, -1, p.dtype, grad_input=d_probs)
                d_qs = _grad_queries_and_keys(d_scores, qs[chunk], key[chunk], grad_key[chunk], queries)
                if rel_key is not None:
                    num_types = rel_key.size(0)
                    d_table = d_scores.new_zeros(*d_scores.shape[:2], num_types + 1)
                    d_table.scatter_add_(-1, queries.column_type.expand_as(d_scores), d_scores)
                    d_table = d_table[..., :num_types].reshape(-1, num_types)
                    d_qs.view(-1, dim).addmm_(d_table, rel_key)
                    grad_rel.addmm_(d_table.transpose(0, 1), qs[chunk].reshape(-1, dim))
                d_query[chunk] = d_qs
            _scatter_rows(grad_query, d_query.mul_(scale), queries)
        shape = (bsz, heads, num_nodes, dim)
        return (grad_query.view(shape), grad_key.view(shape), grad_value.view(shape), grad_rel,
                None, None, None, None)


def tree_block_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                         dropout_p=0.0, scale=None, min_group: int = 32,
                         max_group: int = 64) -> torch.Tensor:
    """Fast exact path for graphs laid out as a tree (``graph.tree``; see the module docstring).

    min_group / max_group: the fewest tokens a query group covers, and the most queries it
    may hold (see ``_tree_plan``); the defaults are the fastest measured on CPU."""
    if scale is None:
        scale = query.size(-1) ** -0.5
    plan = _tree_plan(graph, min_group, max_group, query.device)
    return _TreeAttention.apply(query, key, value, rel_key, key_padding_mask, plan, scale,
                                dropout_p)
