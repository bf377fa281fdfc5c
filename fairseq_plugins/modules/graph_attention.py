"""Sparse multi-head attention over an explicit graph, with pluggable backends.

One op, ``graph_attention``, computes for every query node u

    out_u = sum_{v in in(u), v present} softmax_v(scale * q_u . (k_v + rel_key[type(u, v)])) v_v

where ``in(u)`` is row u of a CSR adjacency (``AttentionGraph``). The graph is shared by all
sentences of a batch; sentences differ only through ``key_padding_mask``.

Backends are looked up by name (``register_backend``). The built-in ``"torch"`` backend has three
exact implementations:

* ``dense_graph_attention``: graphs of at most ``DENSE_MAX_NODES`` nodes (the sentences of MT);
  the full [N, N] score matrix with -inf off the graph, one fused SDPA call. O(N^2), but a few
  large kernels beat the other paths' many small ones at this size.
* ``csr_attention``: any graph; gathers one key/value per edge and does a segment softmax with
  scatter ops. Memory is linear in the number of edges (times the head dim).
* ``tree_block_attention``: graphs built over a binary-partition tree (``graph.tree`` is set,
  nodes laid out as tokens then levels 1, 2, ...). Token queries are processed in blocks of
  consecutive tokens; at every level the keys a block can reach form a narrow band of that
  level, read as a strided window, so each (block, level) pair is one dense GEMM and no per-edge
  gather is needed. Span queries attend to their tokens through a dense reshaped view.
  This is what makes the op faster than dense attention on CPU at long lengths.

The CUDA backend lives in ``graph_attention_cuda`` (imported lazily) and registers itself as
``"cuda"``; it reads the int32 CSR and the transposed CSR cached on the graph.
"""

import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TreeLayout:
    """Structure of a binary-partition-tree graph, used by the fast path.

    Nodes are laid out as ``num_tokens`` token nodes, then the nodes of level 1, level 2, ...;
    level j node m covers tokens [m * 2^j, min((m + 1) * 2^j, num_tokens)).
    Every span row attends to exactly its tokens with type ``ancestor_types[j]`` (plus itself
    with ``self_type`` when ``span_self_loop``); token rows are arbitrary but must stay within
    a band around their ancestor at each level (checked when the block plan is built).
    """

    num_tokens: int
    level_sizes: Tuple[int, ...]  # nodes per level, level 0 = tokens
    ancestor_types: Tuple[int, ...]  # edge type of span(level j) <- token; index 0 unused
    self_type: int
    span_self_loop: bool

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


DENSE_MAX_NODES = 512  # measured crossover on CPU, see docs/bpt.md


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
class _LevelBand:
    level: int
    left: int  # how many level nodes left of the block's first ancestor a token may reach
    width: int  # band width in level nodes
    per_block: int  # level nodes spanned by one block (>= 1)


@dataclass(frozen=True)
class _BlockPlan:
    block: int  # query tokens per block
    num_blocks: int
    bands: Tuple[_LevelBand, ...]
    edge_type: torch.Tensor  # [num_blocks, block, sum(width)], -1 where no edge


def _block_plan(graph: AttentionGraph, block: int) -> _BlockPlan:
    """Place every token edge in its (block, level) band; verify the span rows."""
    key = ("plan", block)
    if key in graph._cache:
        return graph._cache[key]
    tree = graph.tree
    n, offsets = tree.num_tokens, tree.level_offsets
    rows, cols, types = graph.rows(), graph.indices, graph.edge_type
    node_level = torch.repeat_interleave(torch.arange(len(tree.level_sizes)),
                                         torch.tensor(tree.level_sizes))
    node_index = torch.arange(graph.num_nodes) - torch.tensor(offsets)[node_level]
    _check_span_rows(graph, node_level, node_index)

    token_edge = rows < n
    q, c, t = rows[token_edge], cols[token_edge], types[token_edge]
    lvl, idx = node_level[c], node_index[c]
    distance = idx - (q >> lvl)  # key node relative to the query's ancestor at that level
    num_blocks = -(-n // block)
    bands, col_offset, placed_col = [], 0, torch.empty_like(q)
    for j in range(len(tree.level_sizes)):
        at = lvl == j
        per_block = max(block >> j, 1)
        left = int((-distance[at]).clamp_min(0).max()) if at.any() else 0
        right = int(distance[at].clamp_min(0).max()) if at.any() else 0
        # column inside the band: node index minus the band start of the query's block
        start = ((q[at] // block) * block >> j) - left
        placed_col[at] = col_offset + idx[at] - start
        width = per_block + left + right
        bands.append(_LevelBand(j, left, width, per_block))
        col_offset += width
    plan_type = torch.full((num_blocks, block, col_offset), -1, dtype=torch.int64)
    plan_type[q // block, q % block, placed_col] = t
    plan = _BlockPlan(block, num_blocks, tuple(bands), plan_type)
    graph._cache[key] = plan
    return plan


def _check_span_rows(graph, node_level, node_index):
    """The fast path computes span rows from the layout alone; make sure the CSR agrees."""
    tree, n = graph.tree, graph.tree.num_tokens
    rows, cols, types = graph.rows(), graph.indices, graph.edge_type
    span = rows >= n
    r, c, t = rows[span], cols[span], types[span]
    j, m = node_level[r], node_index[r]
    is_self = c == r
    anc = torch.tensor(tree.ancestor_types)[j]
    ok = torch.where(is_self, tree.span_self_loop & (t == tree.self_type),
                     (c < n) & ((c >> j) == m) & (t == anc))
    counts = torch.bincount(r - n, minlength=graph.num_nodes - n)
    span_nodes = torch.arange(n, graph.num_nodes)
    want = (torch.minimum((node_index[span_nodes] + 1) << node_level[span_nodes], torch.tensor(n))
            - (node_index[span_nodes] << node_level[span_nodes]) + int(tree.span_self_loop))
    if not bool(ok.all()) or not torch.equal(counts, want):
        raise ValueError("graph.tree is set but the span rows are not 'all tokens of the span'")


def _windows(level_kv: torch.Tensor, band: _LevelBand, plan: _BlockPlan) -> torch.Tensor:
    """[B, H, size, D] level nodes -> [B, H, num_blocks, width, D] band of every block."""
    size = level_kv.size(2)
    if band.per_block > 1:
        needed = (plan.num_blocks - 1) * band.per_block + band.width
    else:
        needed = (((plan.num_blocks - 1) * plan.block) >> band.level) + band.width
    pad_right = max(needed - band.left - size, 0)
    padded = F.pad(level_kv, (0, 0, band.left, pad_right))
    if band.per_block > 1:
        # materialised: batched matmuls over overlapping strided views fall back to slow loops
        return padded.unfold(2, band.width, band.per_block).transpose(-1, -2).contiguous()
    starts = (torch.arange(plan.num_blocks, device=level_kv.device) * plan.block) >> band.level
    return padded.unfold(2, band.width, 1).transpose(-1, -2)[:, :, starts]


def tree_block_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                         dropout_p=0.0, scale=None, block: int = 64) -> torch.Tensor:
    """Fast exact path for binary-partition-tree graphs (see the module docstring)."""
    tree = graph.tree
    bsz, heads, num_nodes, dim = query.shape
    if scale is None:
        scale = dim ** -0.5
    n, offsets, sizes = tree.num_tokens, tree.level_offsets, tree.level_sizes
    block = min(block, 1 << max(n - 1, 0).bit_length())
    plan = _block_plan(graph, block)
    plan_type = graph._cache.setdefault(("plan_type", block, str(query.device)),
                                        plan.edge_type.to(query.device))
    padded_tokens = plan.num_blocks * block
    present = (~key_padding_mask if key_padding_mask is not None
               else torch.ones(bsz, num_nodes, dtype=torch.bool, device=query.device))
    # split once: per-level slices of the full tensors would each cost a full-size gradient
    q_levels, k_levels, v_levels = (x.split(sizes, dim=2) for x in (query, key, value))
    present_levels = present.split(sizes, dim=1)

    # token queries: one dense score block per (query block, level)
    q_blocks = F.pad(q_levels[0], (0, 0, 0, padded_tokens - n)).view(
        bsz, heads, plan.num_blocks, block, dim)
    scores, present_cols, value_windows = [], [], []
    for band in plan.bands:
        j = band.level
        scores.append(q_blocks @ _windows(k_levels[j], band, plan).transpose(-1, -2))
        value_windows.append(_windows(v_levels[j], band, plan))
        level_present = present_levels[j][:, None, :, None].to(query.dtype)
        present_cols.append(_windows(level_present, band, plan)[:, 0, :, :, 0] > 0)
    scores = torch.cat(scores, -1)  # [B, H, blocks, block, W]
    if rel_key is not None:
        q_rel = q_blocks @ rel_key.transpose(0, 1)  # [B, H, blocks, block, T]
        edge_type = plan_type.clamp_min(0).expand(bsz, heads, -1, -1, -1)
        scores = scores + torch.gather(q_rel, -1, edge_type)
    valid = (plan_type >= 0) & torch.cat(present_cols, -1).unsqueeze(2)  # [B, blocks, block, W]
    probs = _masked_softmax(scores * scale, valid.unsqueeze(1), -1)
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    # split, not slices: each slice's backward would allocate a full-size zero gradient;
    # contiguous: a column slice makes the backward's transposed GEMM take a slow loop
    token_out = 0
    level_probs = probs.split([band.width for band in plan.bands], -1)
    for p_level, v_win in zip(level_probs, value_windows):
        token_out = token_out + p_level.contiguous() @ v_win
    outputs = [token_out.reshape(bsz, heads, padded_tokens, dim)[:, :, :n]]

    # span queries: level j node m attends to its 2^j tokens, read as a reshaped view of the
    # tokens padded once to 2^L; the (few) span queries are padded to match instead
    tokens_pow2 = 1 << (len(sizes) - 1)
    k_tok = F.pad(k_levels[0], (0, 0, 0, tokens_pow2 - n))
    v_tok = F.pad(v_levels[0], (0, 0, 0, tokens_pow2 - n))
    tok_present = F.pad(present_levels[0], (0, tokens_pow2 - n))
    for j in range(1, len(sizes)):
        size, span, rows = sizes[j], 1 << j, tokens_pow2 >> j
        q_span = F.pad(q_levels[j], (0, 0, 0, rows - size))
        k_view = k_tok.view(bsz, heads, rows, span, dim)
        s = (q_span.unsqueeze(-2) @ k_view.transpose(-1, -2)).squeeze(-2)  # [B, H, rows, span]
        if rel_key is not None:
            s = s + (q_span @ rel_key[tree.ancestor_types[j]]).unsqueeze(-1)
        valid_span = tok_present.view(bsz, 1, rows, span)
        if tree.span_self_loop:
            self_key = F.pad(k_levels[j], (0, 0, 0, rows - size))
            if rel_key is not None:
                self_key = self_key + rel_key[tree.self_type]
            s = torch.cat([s, (q_span * self_key).sum(-1, keepdim=True)], -1)
            self_present = F.pad(present_levels[j], (0, rows - size)).view(bsz, 1, rows, 1)
            valid_span = torch.cat([valid_span, self_present], -1)
        p = _masked_softmax(s * scale, valid_span, -1)
        p = F.dropout(p, p=dropout_p, training=dropout_p > 0)
        span_out = (p[..., :span].unsqueeze(-2) @ v_tok.view(bsz, heads, rows, span, dim)).squeeze(-2)
        if tree.span_self_loop:
            span_out = span_out + p[..., span:] * F.pad(v_levels[j], (0, 0, 0, rows - size))
        outputs.append(span_out[:, :, :size])
    return torch.cat(outputs, 2)
