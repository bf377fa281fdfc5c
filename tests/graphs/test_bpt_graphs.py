"""Property tests of the BPT / SegTree graph builders."""

import math

import pytest
import torch

from fairseq_plugins.graphs.binary_partition import (
    TreeEdgeTypes, bpt_graph, bpt_token_contexts, node_levels, node_present, segtree_graph,
    segtree_token_contexts, tree_level_sizes,
)

MAX_N = 256


def all_token_queries(max_n):
    """Every (sentence length n, token i) pair with n <= max_n, flattened."""
    lengths = torch.arange(1, max_n + 1)
    n = torch.repeat_interleave(lengths, lengths)
    i = torch.cat([torch.arange(m) for m in lengths.tolist()])
    return n, i


def coverage(contexts, n, i):
    """[Q, max_n] count of context nodes covering each token, for every query."""
    query, level, node = contexts[0], contexts[1], contexts[2]
    start = node << level
    end = torch.minimum((node + 1) << level, n[query])
    assert bool((start < n[query]).all()), "a context node lies past the end of the sentence"
    top = torch.ceil(torch.log2(n[query].double())).long()
    assert bool((level <= top).all()), "a context node is above the root"
    diff = torch.zeros(len(n), MAX_N + 1, dtype=torch.long)
    diff.index_put_((query, start), torch.ones_like(start), accumulate=True)
    diff.index_put_((query, end), -torch.ones_like(end), accumulate=True)
    return diff.cumsum(1)[:, :MAX_N]


def expected_coverage(n, i, causal):
    positions = torch.arange(MAX_N)
    limit = (i + 1) if causal else n
    return (positions < limit.unsqueeze(1)).long()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_bpt_contexts_are_disjoint_and_cover_the_sentence(k, causal):
    n, i = all_token_queries(MAX_N)
    contexts = bpt_token_contexts(i, n, k, causal, TreeEdgeTypes(k, 2))
    assert torch.equal(coverage(contexts, n, i), expected_coverage(n, i, causal))


@pytest.mark.parametrize("causal", [False, True])
def test_segtree_contexts_are_minimal_disjoint_covers(causal):
    n, i = all_token_queries(MAX_N)
    contexts = segtree_token_contexts(i, n, causal, TreeEdgeTypes(1, 2))
    assert torch.equal(coverage(contexts, n, i), expected_coverage(n, i, causal))
    # minimal: besides itself and its neighbours, a token uses one aligned block per set bit
    # of the remaining left length (and at most one per level on the right)
    degree = torch.bincount(contexts[0], minlength=len(n))
    left_rest = (i - 1).clamp_min(0)
    popcount = sum(((left_rest >> b) & 1) for b in range(9))
    left_degree = popcount + (i >= 1).long()
    if causal:
        assert torch.equal(degree, 1 + left_degree)
    else:
        right_max = 1 + torch.ceil(torch.log2(n.double())).long() + 1
        assert bool((degree - 1 - left_degree <= right_max).all())


def test_bpt_k_at_least_n_attends_every_token_directly():
    n, i = all_token_queries(16)
    contexts = bpt_token_contexts(i, n, 16, False, TreeEdgeTypes(16, 2))
    assert bool((contexts[1] == 0).all())
    assert torch.equal(torch.bincount(contexts[0], minlength=len(n)), n)


def test_original_builder_failure_case_n5_k1():
    """n=5, k=1 is where the original builder produced spurious/duplicate edges."""
    g = bpt_graph(5, 1)
    # nodes: tokens 0-4, level 1: 5=[0,2) 6=[2,4) 7=[4,5), level 2: 8=[0,4) 9=[4,5), root 10
    rows = [g.indices[g.indptr[u]:g.indptr[u + 1]].tolist() for u in range(g.num_nodes)]
    assert rows[:5] == [[0, 1, 6, 9], [0, 1, 2, 3, 7], [0, 1, 2, 3, 7], [2, 3, 4, 5],
                        [2, 3, 4, 5]]
    assert rows[5:] == [[0, 1], [2, 3], [4], [0, 1, 2, 3], [4], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("build, self_loop", [
    (lambda n: bpt_graph(n, 2), False), (lambda n: bpt_graph(n, 4, causal=True), False),
    (lambda n: segtree_graph(n), True),
], ids=["bpt", "bpt-causal", "segtree"])
def test_span_nodes_attend_exactly_their_tokens(build, self_loop):
    for n in [1, 2, 3, 5, 8, 13, 64, 100]:
        g = build(n)
        level, index = node_levels(n)
        assert g.num_nodes == sum(tree_level_sizes(n))
        for u in range(n, g.num_nodes):
            keys = g.indices[g.indptr[u]:g.indptr[u + 1]]
            tokens = keys[keys < n]
            j, m = int(level[u]), int(index[u])
            assert tokens.tolist() == list(range(m << j, min((m + 1) << j, n)))
            assert keys[keys >= n].tolist() == ([u] if self_loop else [])


def test_graph_nodes_and_types_match_the_tree():
    g = bpt_graph(37, 4, clip=3)
    types = TreeEdgeTypes(4, 3)
    assert g.num_edge_types == types.num_types
    level, _ = node_levels(37)
    span_rows = g.rows() >= 37
    expected = torch.tensor([types.ancestor(int(j)) for j in level[g.rows()[span_rows]]])
    assert torch.equal(g.edge_type[span_rows], expected)


def test_padding_restricts_to_the_sentence_graph():
    """The padded-length graph, restricted to a sentence's present nodes, is its own graph."""
    padded = 23
    big = bpt_graph(padded, 2)
    level_big, index_big = node_levels(padded)
    for n in range(1, padded + 1):
        present = node_present(torch.tensor([n]), padded)[0]
        small = bpt_graph(n, 2)
        level_small, index_small = node_levels(n)
        key_of = {(int(a), int(b)): u for u, (a, b) in enumerate(zip(level_small, index_small))}
        assert int(present.sum()) == small.num_nodes
        for u in torch.nonzero(present).flatten().tolist():
            keys = big.indices[big.indptr[u]:big.indptr[u + 1]]
            types = big.edge_type[big.indptr[u]:big.indptr[u + 1]]
            kept = present[keys]
            mapped = sorted((key_of[(int(level_big[v]), int(index_big[v]))], int(t))
                            for v, t in zip(keys[kept], types[kept]))
            s = key_of[(int(level_big[u]), int(index_big[u]))]
            own = list(zip(small.indices[small.indptr[s]:small.indptr[s + 1]].tolist(),
                           small.edge_type[small.indptr[s]:small.indptr[s + 1]].tolist()))
            assert mapped == own, (n, u)


def test_edge_count_is_k_n_log_n_over_k():
    n = 8192
    print()
    for k in [1, 4]:
        g = bpt_graph(n, k)
        token_degree = g.indptr.diff()[:n].float()
        bound = k * n * math.log2(n / k)
        print(f"n={n} k={k}: nodes {g.num_nodes} edges {g.num_edges} "
              f"max token in-degree {int(token_degree.max())} "
              f"edges / (k n log2(n/k)) = {g.num_edges / bound:.2f}")
        assert g.num_nodes < 2 * n + math.log2(n) + 1
        # <= 2(k+1) context nodes per level and side, plus n log n affiliated edges
        assert g.num_edges <= 2 * (k + 1) * n * math.ceil(math.log2(n)) + n * 14 + n
        assert g.num_edges <= 6 * bound + n * math.log2(n)


def test_bad_lengths_raise():
    with pytest.raises(ValueError):
        bpt_graph(0, 4)
    with pytest.raises(ValueError):
        node_present(torch.tensor([3, 0]), 5)
    with pytest.raises(ValueError):
        node_present(torch.tensor([6]), 5)
    with pytest.raises(ValueError):
        TreeEdgeTypes(0, 2)


@pytest.mark.parametrize("kind,k", [("bpt", 1), ("bpt", 2), ("bpt", 4), ("bpt", 64), ("segtree", 1)])
def test_a_decoding_steps_token_context_is_the_graphs(kind, k):
    """The plain-integer context of one token (decoding steps) is the tensor builders' context."""
    from fairseq_plugins.graphs.binary_partition import TreeGraphSpec, causal_token_context

    spec = TreeGraphSpec(kind, k, 3, causal=True)
    for t in range(300):
        expected = spec.token_contexts(torch.tensor([t]), t + 1)[1:].t().tolist()
        assert sorted(map(list, causal_token_context(spec, t))) == sorted(expected), t
