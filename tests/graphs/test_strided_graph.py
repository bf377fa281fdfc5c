"""The Sparse Transformer's fixed strided pattern (``graphs/strided.py``): its edges against the
definition, causality, decoding steps, and the graph-attention op over it against dense
attention with the same mask in float64."""

import pytest
import torch

from fairseq_plugins.graph_attention import graph_attention
from fairseq_plugins.graphs.strided import StridedGraphSpec, strided_graph

PATTERNS = [(1, 1), (4, 1), (4, 2), (4, 4), (5, 3), (8, 3), (16, 8)]
LENGTHS = [1, 3, 5, 16, 37, 64]


def pattern_mask(n: int, stride: int, summary: int) -> torch.Tensor:
    """[n, n] bool, query x key, straight from the definition (Child et al., 2019, "fixed"):
    key j <= i in i's block, or among the last ``summary`` positions of an earlier block."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            same_block = j // stride == i // stride and j <= i
            summary_of_earlier_block = j // stride < i // stride and j % stride >= stride - summary
            mask[i, j] = same_block or summary_of_earlier_block
    return mask


def graph_mask(graph) -> torch.Tensor:
    mask = torch.zeros(graph.num_nodes, graph.num_keys, dtype=torch.bool)
    mask[graph.rows(), graph.indices] = True
    return mask


@pytest.mark.parametrize("stride,summary", PATTERNS)
@pytest.mark.parametrize("n", LENGTHS)
def test_edges_are_the_fixed_pattern(n, stride, summary):
    graph = strided_graph(n, stride, summary)
    assert graph.num_nodes == graph.num_keys == n and graph.num_edge_types == 1
    assert torch.equal(graph_mask(graph), pattern_mask(n, stride, summary))


@pytest.mark.parametrize("stride,summary", PATTERNS)
def test_causal_with_a_self_loop(stride, summary):
    """No edge to the future; every token sees itself (a row is never empty)."""
    graph = strided_graph(64, stride, summary)
    assert bool((graph.indices <= graph.rows()).all())
    assert torch.equal(graph_mask(graph).diagonal(), torch.ones(64, dtype=torch.bool))


def test_the_degree_of_figure5s_setting():
    """c = 8, stride = 128 at l = 512: 64.5 keys in the block and 12 summaries on average."""
    assert strided_graph(512, 128, 8).num_edges / 512 == 76.5


@pytest.mark.parametrize("stride,summary", PATTERNS)
def test_a_decoding_steps_row_is_the_graphs(stride, summary):
    spec, full = StridedGraphSpec(stride, summary), strided_graph(40, stride, summary)
    for t in range(40):
        step = spec.step_graph(t)
        assert step.num_nodes == 1 and step.num_keys == t + 1
        assert torch.equal(step.indices, full.indices[full.indptr[t]:full.indptr[t + 1]])


def test_present_nodes_are_the_tokens_of_each_sentence():
    present = StridedGraphSpec(4, 2).present(torch.tensor([3, 5]), 5)
    assert present.tolist() == [[True, True, True, False, False], [True] * 5]


@pytest.mark.parametrize("stride,summary", [(4, 2), (8, 3), (16, 8)])
def test_op_over_the_graph_is_dense_attention_with_the_mask(stride, summary):
    """graph_attention over the pattern equals softmax attention with the pattern as its mask,
    forward and every gradient, in float64; a padded sentence's absent tokens are no keys."""
    n, heads, dim = 37, 2, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, n, dim, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    rel_key = torch.randn(1, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([n, 29])
    absent = ~StridedGraphSpec(stride, summary).present(lengths, n)
    out = graph_attention(q, k, v, strided_graph(n, stride, summary), rel_key, absent, backend="torch")
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, rel_key), grad)

    mask = pattern_mask(n, stride, summary) & ~absent[:, None, None, :]
    scores = q @ (k + rel_key[0]).transpose(-1, -2) * dim ** -0.5
    dense = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
    expected = torch.autograd.grad(dense, (q, k, v, rel_key), grad)
    torch.testing.assert_close(out, dense, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("args,match", [
    ((0, 1), "sparse-stride must be >= 1"),
    ((4, 0), r"sparse-summary must be in \[1, --sparse-stride = 4\]"),
    ((4, 5), r"sparse-summary must be in \[1, --sparse-stride = 4\]"),
    ((4, 2, False), "causal only"),
])
def test_bad_patterns_raise(args, match):
    with pytest.raises(ValueError, match=match):
        StridedGraphSpec(*args)
