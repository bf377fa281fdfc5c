"""Graphs shared by the tiled-backend tests (triton, cpu)."""

import torch

from fairseq_plugins.graphs.attention_graph import AttentionGraph, TreeLayout
from fairseq_plugins.graphs.binary_partition import tree_level_sizes


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
