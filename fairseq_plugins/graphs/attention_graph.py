"""The graph data types every sparse-attention path reads: ``AttentionGraph`` and ``TreeLayout``.

An ``AttentionGraph`` is one attention pattern (a CSR adjacency with an edge type per edge) shared
by all sentences of a batch; ``TreeLayout`` says that its nodes are laid out over a
binary-partition tree, which the fast paths exploit. Pure torch: builders (``binary_partition``)
make these, the graph attention backends consume them.

What a backend derives from a graph (the CSR on a device, a tile plan, a block mask) is built
once per graph and kept beside it in a ``DerivedCache``, through ``AttentionGraph.derived``:
one bounded cache with typed keys, never a backend's own attribute on the graph. Backends
build their entries before a call runs (``registry.Backend.prepare``), so that a
``torch.compile`` trace only reads them.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, NamedTuple, Optional, Tuple, TypeVar

import torch

T = TypeVar("T")
# derived entries kept per graph: a few devices x dtypes x backends; the oldest one is
# dropped first (the graphs themselves are cached by their builders)
DERIVED_PER_GRAPH = 32


class DerivedKey(NamedTuple):
    """What was derived from a graph: ``kind`` names the data (and the module building it),
    ``device`` where its tensors live, ``params`` the rest of what it depends on."""

    kind: str
    device: str
    params: Tuple[Hashable, ...] = ()


class DerivedCache:
    """Data derived from one graph, built on first use, at most ``capacity`` entries (the
    oldest dropped first). A lookup is one dict read (which a compiled graph can trace);
    two threads missing the same entry at once both build it, and keep one."""

    def __init__(self, capacity: int = DERIVED_PER_GRAPH):
        self.capacity = capacity
        self._entries: Dict[DerivedKey, object] = {}  # in insertion order

    def get(self, key: DerivedKey, build: Callable[[], T]) -> T:
        value = self._entries.get(key)
        if value is None:
            value = self._entries.setdefault(key, build())
            while len(self._entries) > self.capacity:
                self._entries.pop(next(iter(self._entries)))
        return value

    def keys(self) -> Tuple[DerivedKey, ...]:
        return tuple(self._entries)


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
    """One sparse attention pattern over N nodes, shared by every sentence of a batch.

    Usually square: the N nodes are both the queries and the keys. A rectangular graph
    (``num_keys`` != N) has N query rows over ``num_keys`` keys: a decoding step's new nodes
    over the key/value cache; the backends that need a square graph decline it."""

    num_nodes: int  # query rows
    indptr: torch.Tensor  # int64 [N + 1], CSR rows = query nodes
    indices: torch.Tensor  # int64 [E], key node of each edge (sorted within a row)
    edge_type: torch.Tensor  # int64 [E], row index into the relative-position table
    num_edge_types: int
    tree: Optional[TreeLayout] = None  # set by the tree builders; enables the fast path
    num_keys: Optional[int] = None  # key nodes; None = num_nodes (a square graph)
    _derived: DerivedCache = field(default_factory=DerivedCache, compare=False, repr=False, hash=False)

    def __post_init__(self):
        if self.num_keys is None:
            object.__setattr__(self, "num_keys", self.num_nodes)
        n, e = self.num_nodes, self.indices.numel()
        if self.indptr.shape != (n + 1,) or int(self.indptr[0]) != 0 or int(self.indptr[-1]) != e:
            raise ValueError(f"indptr must have {n + 1} entries from 0 to {e} edges")
        if bool((self.indptr.diff() < 0).any()):
            raise ValueError("indptr must be non-decreasing")
        if self.edge_type.shape != self.indices.shape:
            raise ValueError("edge_type and indices must have the same length")
        if e and (int(self.indices.min()) < 0 or int(self.indices.max()) >= self.num_keys):
            raise ValueError("edge key index out of range")
        if self.tree is not None and not self.square:
            raise ValueError("a tree layout needs a square graph")
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

    @property
    def square(self) -> bool:
        """Whether the queries are the keys (every graph but a decoding step's)."""
        return self.num_keys == self.num_nodes

    def derived(self, kind: str, device, build: Callable[[], T], *params: Hashable) -> T:
        """``build()`` (not None), once per (kind, device, params) while this graph lives
        (bounded: ``DERIVED_PER_GRAPH`` entries). The one place backends keep what they
        derive from it."""
        return self._derived.get(DerivedKey(kind, str(device), params), build)

    def rows(self) -> torch.Tensor:
        """Query node of every edge (int64 [E], CPU)."""
        return self.derived("rows", "cpu", lambda: torch.repeat_interleave(
            torch.arange(self.num_nodes), self.indptr.diff(), output_size=self.num_edges))

    def on(self, device, dtype=torch.int64) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr, indices, edge_type) on ``device`` as ``dtype``, cached (kernels use int32)."""
        return self.derived("csr", device, lambda: tuple(
            t.to(device=device, dtype=dtype) for t in (self.indptr, self.indices, self.edge_type)), dtype)

    def transposed(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CSR by key node: (indptr [num_keys + 1], query node [E], edge id [E]), int64 on CPU.

        Lets a backward pass accumulate dK/dV per key node without atomics."""
        def build():
            order = torch.sort(self.indices * self.num_nodes + self.rows()).indices
            counts = torch.bincount(self.indices, minlength=self.num_keys)
            return torch.cat([counts.new_zeros(1), counts.cumsum(0)]), self.rows()[order], order
        return self.derived("transposed", "cpu", build)
