"""The graphs every backend is checked on: the GPU checks here and the CPU tests in ``tests/``.

``TILED_GRAPHS``: name -> (builder, sentence lengths), tree-laid graphs from 1 token to
rows long enough to split; ``random_graph``: any CSR (no tree layout), with empty rows and
many edge types; ``random_tree_graph``: random edges over a tree layout."""

import torch

from fairseq_plugins.graphs.attention_graph import AttentionGraph, TreeLayout
from fairseq_plugins.graphs.binary_partition import bpt_graph, segtree_graph, tree_level_sizes


def random_graph(n: int, degree: int, num_types: int, seed: int = 0) -> AttentionGraph:
    """Random CSR with sorted unique keys per row, varying degrees and some empty rows."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = [], []
    for u in range(n):
        d = int(torch.randint(0, 2 * degree + 1, (1,), generator=gen)) if u % 7 else 0
        keys = torch.randperm(n, generator=gen)[: min(d, n)].sort().values
        rows.append(torch.full_like(keys, u))
        cols.append(keys)
    rows, cols = torch.cat(rows), torch.cat(cols)
    counts = torch.bincount(rows, minlength=n)
    return AttentionGraph(num_nodes=n, indptr=torch.cat([counts.new_zeros(1), counts.cumsum(0)]),
                          indices=cols,
                          edge_type=torch.randint(0, num_types, cols.shape, generator=gen),
                          num_edge_types=num_types)


def random_tree_graph(n: int, edges_per_row: int, seed: int = 0) -> AttentionGraph:
    """A tree layout over n tokens with random edges between any nodes (some rows empty)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = tree_level_sizes(n)
    num_nodes = sum(sizes)
    rows = torch.randint(0, num_nodes, (num_nodes * edges_per_row,), generator=gen)
    cols = torch.randint(0, num_nodes, rows.shape, generator=gen)
    pairs = torch.unique(rows * num_nodes + cols)
    rows, cols = pairs // num_nodes, pairs % num_nodes
    counts = torch.bincount(rows, minlength=num_nodes)
    return AttentionGraph(num_nodes=num_nodes,
                          indptr=torch.cat([counts.new_zeros(1), counts.cumsum(0)]),
                          indices=cols, edge_type=torch.randint(0, 7, cols.shape, generator=gen),
                          num_edge_types=7, tree=TreeLayout(n, sizes))


TILED_GRAPHS = {
    "bpt-k1-n1": (lambda: bpt_graph(1, 1), [1]),
    "bpt-k1-n2": (lambda: bpt_graph(2, 1), [2, 1]),
    "bpt-k1-n3": (lambda: bpt_graph(3, 1), [3, 2]),
    "bpt-k2-n5": (lambda: bpt_graph(5, 2), [5, 3]),
    "bpt-k2-n17": (lambda: bpt_graph(17, 2), [17, 9]),
    "bpt-k8-n64": (lambda: bpt_graph(64, 8), [64, 33]),
    "bpt-k4-n100": (lambda: bpt_graph(100, 4), [100, 57]),
    "bpt-k2-causal-n100": (lambda: bpt_graph(100, 2, causal=True), [100, 40]),
    "segtree-n64": (lambda: segtree_graph(64), [64, 30]),
    "random-tree-n40": (lambda: random_tree_graph(40, 6), [40, 40]),
    "bpt-k4-n257": (lambda: bpt_graph(257, 4), [257, 200]),
    "bpt-k4-n1000": (lambda: bpt_graph(1000, 4), [1000, 700]),
}
