"""The fused kernels' work plan (cuda_backend.kernel_plan), built on the CPU: every edge is
in exactly one piece, long rows are split, pieces run longest first, rows are ordered by
edge type, the transposed CSR matches, and bad index contents are rejected once."""

import pytest
import torch

from fairseq_plugins.check_gpu.cases import random_graph
from fairseq_plugins.graph_attention import cuda_backend
from fairseq_plugins.graphs.binary_partition import bpt_graph


def check_schedule(schedule, indptr, split, multi_type):
    pieces, merges = schedule.pieces.long(), schedule.merges.long()
    row, begin, end, slot, multi = pieces.unbind(1)
    lengths = end - begin
    assert bool((lengths <= split).all()) and bool((lengths.diff() <= 0).all())  # longest first
    assert torch.equal(multi.bool(), multi_type[row])
    covered = torch.zeros(int(indptr[-1]), dtype=torch.long)
    for r, b, e in zip(row.tolist(), begin.tolist(), end.tolist()):
        assert indptr[r] <= b <= e <= indptr[r + 1]
        covered[b:e] += 1
    assert bool((covered == 1).all())  # every edge exactly once
    assert torch.equal(torch.bincount(row, minlength=indptr.numel() - 1).clamp_max(1),
                       torch.ones(indptr.numel() - 1, dtype=torch.long))  # every row
    # split rows: their pieces own consecutive slots, listed in the merge table
    assert sorted(slot[slot >= 0].tolist()) == list(range(schedule.num_slots))
    for r, first, count, m in merges.tolist():
        own = sorted(slot[row == r].tolist())
        assert own == list(range(first, first + count)) and count > 1 and m == multi_type[r]
    assert set(merges[:, 0].tolist()) == set(row[slot >= 0].tolist())


@pytest.mark.parametrize("graph", [bpt_graph(300, 4), random_graph(60, 12, 5),
                                   random_graph(50, 20, 400)],
                         ids=["bpt", "random", "random_400_types"])
@pytest.mark.parametrize("split", [3, 64])
def test_plan_covers_every_edge_once_longest_first(graph, split):
    plan = cuda_backend.kernel_plan(graph, split)
    order = plan.edge_order
    assert torch.equal(order.sort().values, torch.arange(graph.num_edges))
    assert torch.equal(plan.indices.long(), graph.indices[order])
    assert torch.equal(plan.edge_type.long(), graph.edge_type[order])
    rows = graph.rows()
    assert torch.equal(rows[order], rows)  # edges move only within their row
    # within a row, by type: each (row, type) is one run
    key = rows * graph.num_edge_types + plan.edge_type.long()
    assert bool((key.diff() >= 0).all())
    types_per_row = torch.zeros(graph.num_nodes, graph.num_edge_types, dtype=torch.bool)
    types_per_row[rows, graph.edge_type] = True
    multi_type = types_per_row.sum(1) > 1
    check_schedule(plan.by_query, graph.indptr, split, multi_type)
    for _, begin, end, _, _ in plan.by_query.pieces.tolist():  # one type window per piece
        assert len(set((plan.edge_type[begin:end] // cuda_backend.TYPE_WINDOW).tolist())) <= 1

    # transposed: the edges of each key, their queries and kernel positions
    t_indptr = torch.cat([torch.zeros(1, dtype=torch.long),
                          torch.bincount(graph.indices, minlength=graph.num_nodes).cumsum(0)])
    check_schedule(plan.by_key, t_indptr, split, torch.zeros(graph.num_nodes, dtype=torch.bool))
    t_edge, t_query = plan.t_edge.long(), plan.t_query.long()
    key_of = torch.repeat_interleave(torch.arange(graph.num_nodes), t_indptr.diff())
    assert torch.equal(plan.indices.long()[t_edge], key_of)
    assert torch.equal(rows[t_edge], t_query)
    assert torch.equal(t_edge.sort().values, torch.arange(graph.num_edges))


def test_bpt_split_rows_are_the_single_type_span_rows():
    """At n = 1024, k = 4 only spans of 256+ tokens exceed 256 edges; their edges all have
    one type (span <- its tokens), so dQ stores no type sums for them."""
    plan = cuda_backend.kernel_plan(bpt_graph(1024, 4))
    merges = plan.by_query.merges
    assert merges.size(0) > 0 and not bool(merges[:, 3].any())


@pytest.mark.parametrize("corrupt,message", [
    (lambda g: g.indptr.__setitem__(1, int(g.indptr[2]) + 1), "non-decreasing"),
    (lambda g: g.indices.__setitem__(0, g.num_nodes), "key index out of range"),
    (lambda g: g.edge_type.__setitem__(-1, -1), "edge type out of range"),
    (lambda g: g.indptr.__setitem__(0, 1), "from 0"),
])
def test_bad_index_contents_are_rejected(corrupt, message):
    graph = random_graph(10, 3, 2)
    graph = type(graph)(graph.num_nodes, graph.indptr.clone(), graph.indices.clone(),
                        graph.edge_type.clone(), graph.num_edge_types)
    corrupt(graph)  # after construction, as a caller mutating a graph's tensors would
    with pytest.raises(ValueError, match=message):
        cuda_backend.kernel_plan(graph)
