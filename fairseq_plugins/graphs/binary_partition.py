"""Binary-partition graphs of BP-Transformer and SegTree Transformer.

The tree: level j node m covers tokens [m * 2^j, min((m + 1) * 2^j, n)) for every m with
m * 2^j < n, for levels j = 0 (tokens) .. ceil(log2 n) (the root). Because the blocks are
aligned to powers of two and merely truncated at n, the graph built for a padded length N,
restricted to the nodes a shorter sentence of length n actually has (``node_present``), is
exactly that sentence's own graph: padding never changes a result.

Node layout: the n token nodes first, then level 1, level 2, ... (``TreeLayout``).

Edges (``u <- v`` means query u attends to key v):
* affiliated: span <- each of its tokens (type "ancestor at level j");
* contextual, BPT (Algorithm 1 of the paper, 0-based): token i <- itself, then from each side
  k nodes per level, going up a level after k; when the last node taken on the right is a left
  child (on the left: the first taken is a right child) its sibling is taken too, so the next
  level starts on an aligned boundary. The chosen nodes are disjoint and cover [0, n) exactly.
* contextual, SegTree: token i <- itself, its neighbours i - 1 and i + 1, and the minimal set of
  tree nodes covering the rest of the sentence; span nodes also attend to themselves.
* causal (decoders): only the left side and the token itself, covering [0, i].

Edge types (the relative positions of Eq. 13): self; left/right slot s (0..k) at level j; ancestor
at level j. Levels above ``clip`` share the embeddings of level ``clip``.

Contexts are found with tensor ops over all tokens at once (loops only over levels and slots),
and each graph is built once per (length, options) and cached.
"""

import functools
from dataclasses import dataclass
from typing import List, Tuple

import torch

from fairseq_plugins.graphs.attention_graph import AttentionGraph, TreeLayout


def tree_level_sizes(n: int) -> Tuple[int, ...]:
    """Nodes per level of the truncated aligned binary tree over n tokens (level 0 = tokens)."""
    if n < 1:
        raise ValueError(f"a tree needs at least one token, got length {n}")
    sizes, j = [n], 1
    while (1 << (j - 1)) < n:
        sizes.append(-(-n // (1 << j)))
        j += 1
    return tuple(sizes)


@dataclass(frozen=True)
class TreeEdgeTypes:
    """Numbering of the relative-position types for a given k and level clip."""

    k: int
    clip: int

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.clip < 1:
            raise ValueError(f"the relative-position level clip must be >= 1, got {self.clip}")

    @property
    def slots(self) -> int:  # nodes a side can take per level: k, plus the aligning sibling
        return self.k + 1

    @property
    def self_type(self) -> int:
        return 0

    def left(self, level, slot):
        return 1 + 2 * self.slots * min(level, self.clip) + slot

    def right(self, level, slot):
        return 1 + 2 * self.slots * min(level, self.clip) + self.slots + slot

    def ancestor(self, level):
        return 1 + 2 * self.slots * (self.clip + 1) + min(level, self.clip) - 1

    @property
    def num_types(self) -> int:
        return 1 + 2 * self.slots * (self.clip + 1) + self.clip


class _Edges:
    """Accumulates (query, level, node, type) context edges with tensor ops.

    ``query`` is the index of the query in the ``positions`` tensor given to the context
    functions (equal to the token position when all tokens of one sentence are asked for)."""

    def __init__(self, num_queries: int):
        self.query = torch.arange(num_queries)
        self.parts = []

    def add(self, keep, level, node, edge_type):
        keep = keep.bool()
        fields = [torch.as_tensor(f).expand_as(self.query)[keep] for f in (level, node, edge_type)]
        self.parts.append(torch.stack([self.query[keep]] + fields))

    def cat(self):
        return torch.cat(self.parts, 1) if self.parts else torch.zeros(4, 0, dtype=torch.long)


def bpt_token_contexts(positions: torch.Tensor, n, k: int, causal: bool,
                       types: TreeEdgeTypes) -> torch.Tensor:
    """Context nodes of tokens ``positions`` (1-D) in sentences of length n (int or per query).

    BPT, Algorithm 1. Returns int64 [4, E]: query (index into ``positions``), key level, key
    index within the level, edge type."""
    pos = positions.long()
    n = torch.as_tensor(n).expand_as(pos)
    edges = _Edges(pos.numel())
    edges.add(torch.ones_like(pos), 0, pos, types.self_type)

    end, level = pos.clone(), 0  # left side: nodes end at `end` (aligned to 2^level)
    active = end > 0
    while bool(active.any()):
        last = (end >> level) - 1
        for slot in range(k):
            edges.add(active & (last - slot >= 0), level, last - slot, types.left(level, slot))
        first = last - (k - 1)
        sibling = active & (first >= 1) & (first % 2 == 1)
        edges.add(sibling, level, first - 1, types.left(level, k))
        first = torch.where(sibling, first - 1, first).clamp_min(0)
        end = torch.where(active, first << level, end)
        active = active & (end > 0)
        level += 1

    if not causal:
        start, level = pos + 1, 0  # right side: nodes start at `start` (aligned to 2^level)
        active = start < n
        while bool(active.any()):
            first = start >> level
            for slot in range(k):
                edges.add(active & ((first + slot) << level < n), level, first + slot,
                          types.right(level, slot))
            last = first + k - 1
            sibling = active & (last % 2 == 0)
            edges.add(sibling & ((last + 1) << level < n), level, last + 1,
                      types.right(level, k))
            start = torch.where(active, (last + 1 + sibling.long()) << level, start)
            active = active & (start < n)
            level += 1
    return edges.cat()


def _lowest_set_bit_level(x: torch.Tensor) -> torch.Tensor:
    """j such that 2^j is the lowest set bit of x (x > 0)."""
    return torch.log2((x & -x).double()).round().long()


def segtree_token_contexts(positions: torch.Tensor, n, causal: bool,
                           types: TreeEdgeTypes) -> torch.Tensor:
    """Context nodes of tokens ``positions`` (SegTree): self, neighbours, minimal cover.

    Same return format as ``bpt_token_contexts``; slot 1 at level 0 marks the second token on
    a side (the first one after the neighbour)."""
    pos = positions.long()
    n = torch.as_tensor(n).expand_as(pos)
    edges = _Edges(pos.numel())
    edges.add(torch.ones_like(pos), 0, pos, types.self_type)
    edges.add(pos >= 1, 0, pos - 1, types.left(0, 0))
    end = (pos - 1).clamp_min(0)  # minimal aligned cover of [0, end), largest blocks first
    while bool((end > 0).any()):
        active = end > 0
        level = torch.where(active, _lowest_set_bit_level(end.clamp_min(1)), 0)
        edges.add(active, level, (end >> level) - 1,
                  torch.where(level == 0, types.left(0, 1), _clipped(types.left, level, 0)))
        end = torch.where(active, end - (torch.ones_like(level) << level), end)
    if not causal:
        edges.add(pos + 1 < n, 0, pos + 1, types.right(0, 0))
        start = pos + 2  # minimal aligned cover of [start, n)
        while bool((start < n).any()):
            active = start < n
            level = torch.where(active, _lowest_set_bit_level(start), 0)
            edges.add(active, level, start >> level,
                      torch.where(level == 0, types.right(0, 1), _clipped(types.right, level, 0)))
            start = torch.where(active, start + (torch.ones_like(level) << level), start)
    return edges.cat()


def _clipped(type_fn, level: torch.Tensor, slot: int) -> torch.Tensor:
    """Vectorised type_fn(level, slot) over a tensor of levels."""
    return torch.tensor([type_fn(j, slot) for j in range(int(level.max()) + 1)])[level]


def _assemble(n: int, contexts: torch.Tensor, types: TreeEdgeTypes,
              span_self_loop: bool) -> AttentionGraph:
    sizes = tree_level_sizes(n)
    offsets = torch.tensor((0,) + sizes).cumsum(0)[:-1]
    num_nodes = sum(sizes)
    query, level, node, edge_type = contexts
    rows, cols, etypes = [query], [offsets[level] + node], [edge_type]
    tokens = torch.arange(n)
    for j in range(1, len(sizes)):  # affiliated edges: span <- each of its tokens
        rows.append(offsets[j] + (tokens >> j))
        cols.append(tokens)
        etypes.append(torch.full((n,), types.ancestor(j)))
        if span_self_loop:
            spans = offsets[j] + torch.arange(sizes[j])
            rows.append(spans)
            cols.append(spans)
            etypes.append(torch.full((sizes[j],), types.self_type))
    rows, cols, etypes = torch.cat(rows), torch.cat(cols), torch.cat(etypes)
    order = torch.argsort(rows * num_nodes + cols)
    rows, cols, etypes = rows[order], cols[order], etypes[order]
    counts = torch.bincount(rows, minlength=num_nodes)
    tree = TreeLayout(num_tokens=n, level_sizes=sizes)
    return AttentionGraph(
        num_nodes=num_nodes, indptr=torch.cat([counts.new_zeros(1), counts.cumsum(0)]),
        indices=cols, edge_type=etypes, num_edge_types=types.num_types, tree=tree,
    )


@functools.lru_cache(maxsize=256)
def bpt_graph(n: int, k: int, causal: bool = False, clip: int = 2) -> AttentionGraph:
    """BP-Transformer graph over n tokens (cached per arguments)."""
    types = TreeEdgeTypes(k, clip)
    tree_level_sizes(n)
    return _assemble(n, bpt_token_contexts(torch.arange(n), n, k, causal, types), types, False)


@functools.lru_cache(maxsize=256)
def segtree_graph(n: int, causal: bool = False, clip: int = 2) -> AttentionGraph:
    """SegTree Transformer graph over n tokens (cached per arguments)."""
    types = TreeEdgeTypes(1, clip)
    tree_level_sizes(n)
    return _assemble(n, segtree_token_contexts(torch.arange(n), n, causal, types), types, True)


def node_present(lengths: torch.Tensor, padded_length: int) -> torch.Tensor:
    """[B, N] bool: which nodes of the padded-length tree exist for sentences of ``lengths``.

    A node exists when it covers at least one real token and is not above the sentence's own
    root (those would duplicate the root)."""
    sizes = tree_level_sizes(padded_length)
    level = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    index = torch.cat([torch.arange(s) for s in sizes])
    lengths = lengths.long().cpu().unsqueeze(1)
    if bool((lengths < 1).any()) or bool((lengths > padded_length).any()):
        raise ValueError(f"sentence lengths must be in [1, {padded_length}], got "
                         f"{lengths.flatten().tolist()}")
    top_level = torch.ceil(torch.log2(lengths.double())).long()
    return ((index << level) < lengths) & (level <= top_level)


def root_rows(lengths: torch.Tensor, padded_length: int) -> torch.Tensor:
    """[B] int64: the row of each sentence's root in the node layout of the padded-length tree.

    A sentence of length n has its root at level ceil(log2 n), index 0 (a one-token sentence:
    its token); the classifiers of BPT and SegTree read the sentence's state there."""
    sizes = tree_level_sizes(padded_length)
    lengths = lengths.long()
    if bool((lengths < 1).any()) or bool((lengths > padded_length).any()):
        raise ValueError(f"sentence lengths must be in [1, {padded_length}], got {lengths.flatten().tolist()}")
    offsets = torch.tensor((0,) + sizes[:-1], device=lengths.device).cumsum(0)
    top_level = torch.ceil(torch.log2(lengths.double())).long()
    return offsets[top_level]


def node_levels(n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(level, index within level) of every node of the tree over n tokens."""
    sizes = tree_level_sizes(n)
    level = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return level, torch.cat([torch.arange(s) for s in sizes])


@dataclass(frozen=True)
class TreeGraphSpec:
    """Which tree graph a model side uses; builds (cached) graphs and decoding steps."""

    kind: str  # "bpt" or "segtree"
    k: int
    clip: int
    causal: bool

    def __post_init__(self):
        if self.kind not in ("bpt", "segtree"):
            raise ValueError(f"unknown tree graph kind {self.kind!r}")
        TreeEdgeTypes(self.k, self.clip)

    @property
    def types(self) -> TreeEdgeTypes:
        return TreeEdgeTypes(self.k if self.kind == "bpt" else 1, self.clip)

    @property
    def span_self_loop(self) -> bool:
        return self.kind == "segtree"

    @property
    def num_edge_types(self) -> int:
        return self.types.num_types

    def build(self, n: int) -> AttentionGraph:
        if self.kind == "bpt":
            return bpt_graph(n, self.k, self.causal, self.clip)
        return segtree_graph(n, self.causal, self.clip)

    def present(self, lengths: torch.Tensor, padded_length: int) -> torch.Tensor:
        return node_present(lengths, padded_length)

    def step_graph(self, t: int) -> AttentionGraph:
        return causal_step_graph(self, t)

    def token_contexts(self, positions: torch.Tensor, n) -> torch.Tensor:
        if self.kind == "bpt":
            return bpt_token_contexts(positions, n, self.k, self.causal, self.types)
        return segtree_token_contexts(positions, n, self.causal, self.types)


def causal_token_context(spec: "TreeGraphSpec", t: int) -> List[Tuple[int, int, int]]:
    """(level, index, type) of the nodes token t attends to in a causal graph: the same nodes as
    ``token_contexts`` (BPT's left side, SegTree's left neighbour and cover) for one token, in
    plain integers: a decoding step asks for one token, where the tensor ops' overhead would
    dominate (and grow with the levels)."""
    types = spec.types
    edges = [(0, t, types.self_type)]
    if spec.kind == "bpt":
        end, level = t, 0
        while end > 0:
            last = (end >> level) - 1
            edges += [(level, last - slot, types.left(level, slot)) for slot in range(spec.k) if last - slot >= 0]
            first = last - (spec.k - 1)
            if first >= 1 and first % 2 == 1:
                edges.append((level, first - 1, types.left(level, spec.k)))
                first -= 1
            end, level = max(first, 0) << level, level + 1
        return edges
    if t >= 1:
        edges.append((0, t - 1, types.left(0, 0)))
    end = max(t - 1, 0)
    while end > 0:
        level = (end & -end).bit_length() - 1
        edges.append((level, (end >> level) - 1, types.left(0, 1) if level == 0 else types.left(level, 0)))
        end -= 1 << level
    return edges


def creation_slot(level: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Slot of node (level, index) when a causal tree grows one token at a time.

    Step s appends token s, then every span completed by it (levels 1, 2, ... in order);
    before step s there are s + sum_j floor(s / 2^j) = 2s - popcount(s) nodes."""
    step = ((index + 1) << level) - 1
    popcount = sum((step >> b) & 1 for b in range(63))
    return 2 * step - popcount + level


def nodes_created(steps: int) -> int:
    """Nodes of a causal tree after ``steps`` decoding steps (``creation_slot``'s count)."""
    return 2 * steps - bin(steps).count("1")


@functools.lru_cache(maxsize=4096)
def causal_step_graph(spec: TreeGraphSpec, t: int) -> AttentionGraph:
    """The rectangular graph of decoding step t: the rows of the nodes it creates over the
    key/value cache slots of every node created so far (theirs included: the new nodes'
    keys/values are appended to the cache before attending).

    The nodes are token t, then the spans that token t completes (levels 1..); their keys are
    cache slots (``creation_slot``). A token's causal context holds O(k log t) nodes; a span
    completed at step t reads its 2^j tokens, i.e. O(log t) tokens per step amortised."""
    if not spec.causal:
        raise ValueError("incremental decoding needs a causal graph")
    context = causal_token_context(spec, t)
    # creation_slot of each context node, in integers: the nodes before its step, plus its level
    rows = [torch.tensor([nodes_created(((index + 1) << level) - 1) + level for level, index, _ in context])]
    row_types = [torch.tensor([edge_type for _, _, edge_type in context])]
    j = 1
    while (t + 1) % (1 << j) == 0:
        m = (t + 1) // (1 << j) - 1
        tokens = torch.arange(m << j, (m + 1) << j)
        keys = creation_slot(torch.zeros_like(tokens), tokens)
        types = torch.full_like(tokens, spec.types.ancestor(j))
        if spec.span_self_loop:
            keys = torch.cat([keys, creation_slot(torch.tensor([j]), torch.tensor([m]))])
            types = torch.cat([types, torch.tensor([spec.types.self_type])])
        rows.append(keys)
        row_types.append(types)
        j += 1
    counts = torch.tensor([len(r) for r in rows])
    row = torch.repeat_interleave(torch.arange(len(rows)), counts)
    keys, types = torch.cat(rows), torch.cat(row_types)
    num_keys = nodes_created(t + 1)
    order = torch.argsort(row * num_keys + keys)  # keys in order within each row
    return AttentionGraph(len(rows), torch.cat([counts.new_zeros(1), counts.cumsum(0)]), keys[order],
                          types[order], spec.types.num_types, num_keys=num_keys)
