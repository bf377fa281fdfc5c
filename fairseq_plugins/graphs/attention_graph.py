"""The graph data types every sparse-attention path reads: ``AttentionGraph`` and ``TreeLayout``.

An ``AttentionGraph`` is one attention pattern (a CSR adjacency with an edge type per edge) shared
by all sentences of a batch; ``TreeLayout`` says that its nodes are laid out over a
binary-partition tree, which the fast paths exploit. Pure torch: builders (``binary_partition``)
make these, the graph attention backends consume them.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch


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
