"""graph_attention against a dense masked float64 reference (forward and gradients)."""

import pytest
import torch

from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present, segtree_graph
from fairseq_plugins.graph_attention import (
    AttentionGraph, TreeLayout, csr_attention, dense_graph_attention, graph_attention,
)
from fairseq_plugins.graph_attention.torch_tree import tree_block_attention


def dense_reference(q, k, v, graph, rel_key, key_padding_mask, scale):
    """Full [N, N] scores with -inf off the graph; rows with no key give zeros."""
    n = graph.num_nodes
    adjacency = torch.zeros(n, n, dtype=torch.bool)
    adjacency[graph.rows(), graph.indices] = True
    types = torch.zeros(n, n, dtype=torch.long)
    types[graph.rows(), graph.indices] = graph.edge_type
    scores = q @ k.transpose(-1, -2)
    if rel_key is not None:
        scores = scores + torch.gather(q @ rel_key.T, -1, types.expand(*q.shape[:2], n, n))
    valid = adjacency.expand(q.size(0), 1, n, n)
    if key_padding_mask is not None:
        valid = valid & ~key_padding_mask[:, None, None, :]
    scores = (scores * scale).masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v


def random_inputs(graph, bsz=2, heads=3, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (bsz, heads, graph.num_nodes, dim)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    rel = torch.randn(graph.num_edge_types, dim, generator=gen, dtype=torch.float64,
                      requires_grad=True)
    return q, k, v, rel


def assert_matches_reference(fn, graph, lengths):
    q, k, v, rel = random_inputs(graph, bsz=len(lengths))
    n = graph.tree.num_tokens
    mask = ~node_present(torch.tensor(lengths), n)
    scale = 0.3
    out = fn(q, k, v, graph, rel, mask, scale)
    ref = dense_reference(q, k, v, graph, rel, mask, scale)
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, rel), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v, rel), grad_out)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def generic(q, k, v, graph, rel, mask, scale):
    indptr, indices, types = graph.on(q.device)
    return csr_attention(q, k, v, indptr, indices, types, rel, mask, 0.0, scale)


def blocked(q, k, v, graph, rel, mask, scale):
    return tree_block_attention(q, k, v, graph, rel, mask, 0.0, scale, group_tokens=2)


def dense(q, k, v, graph, rel, mask, scale):
    return dense_graph_attention(q, k, v, graph, rel, mask, 0.0, scale)


def op(q, k, v, graph, rel, mask, scale):
    return graph_attention(q, k, v, graph, rel, mask, scale=scale)


GRAPHS = {
    "bpt-k1": lambda n: bpt_graph(n, 1),
    "bpt-k2-causal": lambda n: bpt_graph(n, 2, causal=True, clip=3),
    "bpt-k4": lambda n: bpt_graph(n, 4),
    "segtree": lambda n: segtree_graph(n),
    "segtree-causal": lambda n: segtree_graph(n, causal=True),
}


@pytest.mark.parametrize("path", [generic, blocked, dense, op], ids=["csr", "block", "dense", "op"])
@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("n", [1, 7, 37])
def test_equals_dense_reference(path, name, n):
    lengths = [n, max(1, n - 4)]
    assert_matches_reference(path, GRAPHS[name](n), lengths)


def test_k_at_least_n_is_full_attention_with_relative_positions():
    n = 11
    graph = bpt_graph(n, 16)
    q, k, v, rel = random_inputs(graph, bsz=1)
    out = graph_attention(q, k, v, graph, rel)[:, :, :n]
    # same thing as dense attention over the tokens with a Shaw-style bias q . r[type(i, j)]
    rows, cols = graph.rows(), graph.indices
    token_edge = (rows < n) & (cols < n)
    assert int(token_edge.sum()) == n * n
    types = torch.zeros(n, n, dtype=torch.long)
    types[rows[token_edge], cols[token_edge]] = graph.edge_type[token_edge]
    qt, kt, vt = q[:, :, :n], k[:, :, :n], v[:, :, :n]
    bias = torch.gather(qt @ rel.T, -1, types.expand(1, 3, n, n))
    full = torch.softmax((qt @ kt.transpose(-1, -2) + bias) * 8 ** -0.5, -1) @ vt
    torch.testing.assert_close(out, full)


def test_rows_without_keys_give_zero_output_and_zero_grad():
    graph = bpt_graph(6, 1)
    q, k, v, rel = random_inputs(graph, bsz=1)
    mask = torch.ones(1, graph.num_nodes, dtype=torch.bool)
    out = graph_attention(q, k, v, graph, rel, mask)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_generic_graph_and_dropout():
    indptr = torch.tensor([0, 2, 2, 5])
    indices = torch.tensor([0, 2, 0, 1, 2])
    graph = AttentionGraph(3, indptr, indices, torch.tensor([0, 1, 1, 0, 2]), 3)
    q, k, v, rel = random_inputs(graph, bsz=2)
    out = graph_attention(q, k, v, graph, rel)
    torch.testing.assert_close(out, dense_reference(q, k, v, graph, rel, None, 8 ** -0.5))
    torch.manual_seed(0)
    dropped = graph_attention(q, k, v, graph, rel, dropout_p=0.5)
    assert not torch.allclose(dropped, out)


def test_bad_input_raises():
    graph = bpt_graph(5, 2)
    q, k, v, rel = random_inputs(graph)
    with pytest.raises(ValueError, match="nodes"):
        graph_attention(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], graph)
    with pytest.raises(ValueError, match="rel_key"):
        graph_attention(q, k, v, graph, rel[:-1])
    with pytest.raises(ValueError, match="backend"):
        graph_attention(q, k, v, graph, backend="nonexistent")
    with pytest.raises(ValueError, match="increasing"):
        AttentionGraph(2, torch.tensor([0, 2, 2]), torch.tensor([1, 0]), torch.zeros(2, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="levels"):
        TreeLayout(5, (5, 2))
    with pytest.raises(ValueError, match="tree layout has 8 nodes"):
        AttentionGraph(3, torch.tensor([0, 0, 0, 0]), torch.tensor([], dtype=torch.long),
                       torch.tensor([], dtype=torch.long), 1, TreeLayout(5, (5, 3)))


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_tree_path_with_default_groups_equals_reference(name):
    """Long enough for band levels, full levels and padded query groups at the default sizes."""
    assert_matches_reference(tree_block_attention_default, GRAPHS[name](300), [300, 131])


def tree_block_attention_default(q, k, v, graph, rel, mask, scale):
    return tree_block_attention(q, k, v, graph, rel, mask, 0.0, scale)


def test_tree_path_dropout_gradients():
    """The hand-written backward applies the same dropout mask as the forward."""
    graph = bpt_graph(13, 1)
    q, k, v, rel = random_inputs(graph, bsz=1, heads=1, dim=4)
    mask = ~node_present(torch.tensor([10]), 13)

    def attend(q, k, v, rel):
        torch.manual_seed(0)  # the same dropout mask at every call
        return tree_block_attention(q, k, v, graph, rel, mask, 0.3, None, group_tokens=4)

    assert not torch.allclose(attend(q, k, v, rel), tree_block_attention(q, k, v, graph, rel, mask))
    assert torch.autograd.gradcheck(attend, (q, k, v, rel))


@pytest.mark.parametrize("size,groups,share,stride,left,width", [
    (37, 5, 1, 8, 3, 13),  # bands overhang both ends
    (37, 9, 1, 2, 3, 13),  # a coarse level: folded by one indexed add
    (9, 4, 1, 2, 6, 11),  # every band overhangs: no inner run
    (16, 3, 1, 4, 0, 4),  # exact tiling
    (5, 7, 2, 1, 2, 5),  # consecutive groups share a band
])
def test_band_fold_is_the_adjoint_of_the_band_windows(size, groups, share, stride, left, width):
    """The tree path's backward folds band gradients with strided adds; autograd through the
    forward's windows (pad + unfold) is the reference."""
    from fairseq_plugins.graph_attention.torch_tree import (
        _KeyBand, _add_unbanded, _pad_level, _windows,
    )
    band = _KeyBand(0, size, False, share, stride, left, width, 0)
    level = torch.randn(2, size, 3, dtype=torch.float64, requires_grad=True)
    windows = _windows(_pad_level(level, band, groups), band, groups)
    d_windows = torch.randn_like(windows)
    (expected,) = torch.autograd.grad(windows, level, d_windows)
    folded = torch.zeros(2, size + 4, 3, dtype=torch.float64)[:, 2:2 + size]  # a strided target
    _add_unbanded(folded, d_windows, band)
    torch.testing.assert_close(folded, expected)


@pytest.fixture
def one_row_chunks(monkeypatch):
    """The tree path with chunks of one (sentence x head) row: many chunks per query set and a
    workspace reused from set to set."""
    from fairseq_plugins.graph_attention import torch_tree
    monkeypatch.setattr(torch_tree, "FLOATS_PER_CHUNK", 1)


@pytest.mark.parametrize("name", ["bpt-k4", "segtree-causal"])
def test_recomputing_backward_over_many_chunks_equals_reference(name, one_row_chunks):
    """The backward recomputes every chunk's probabilities from the saved log-sum-exp: forward
    and every gradient match the float64 reference, with padding and rows without a key."""
    assert_matches_reference(tree_block_attention_default, GRAPHS[name](150), [150, 77, 3])


def test_tree_path_keeps_no_probabilities():
    """What the forward saves is the inputs, the output and one log-sum-exp per row: nothing
    of the size of the scores."""
    graph = bpt_graph(300, 4)
    q, k, v, rel = random_inputs(graph)
    out = tree_block_attention(q, k, v, graph, rel, dropout_p=0.1)
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    inputs = 4 * q.numel() + rel.numel()  # query, key, value, output
    assert sum(t.numel() for t in saved) <= inputs + 3 * q.shape[0] * q.shape[1] * graph.num_nodes


def test_tree_path_dropout_over_many_chunks(one_row_chunks):
    """Each chunk draws its dropout mask from the call's seed: the same mask again in the
    backward (gradcheck), another one in the next call."""
    graph = bpt_graph(40, 1)
    q, k, v, rel = random_inputs(graph, bsz=2, heads=2, dim=4)
    mask = ~node_present(torch.tensor([40, 23]), 40)

    def attend(q, k, v, rel):
        torch.manual_seed(0)
        return tree_block_attention(q, k, v, graph, rel, mask, 0.4, None, group_tokens=8)

    assert torch.equal(attend(q, k, v, rel), attend(q, k, v, rel))
    assert not torch.equal(attend(q, k, v, rel),
                           tree_block_attention(q, k, v, graph, rel, mask, 0.4, None, group_tokens=8))
    # fast mode checks the Jacobian along random directions: a mask drawn afresh in the
    # backward fails it as surely, in a few calls instead of one per input element
    assert torch.autograd.gradcheck(attend, (q, k, v, rel), fast_mode=True)
