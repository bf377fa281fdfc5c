"""The ``cpu`` backend (fused C++ kernel, ``cpu_ext/``) against the float64 torch reference.

Forward and every gradient (q, k, v, rel_key) in float64 to ~1e-10 on BPT (k 1/2/4/8/64,
causal), SegTree, random tree-laid and tree-free graphs, n from 1 to 1000, padding, rows
without keys, head dims 32/64/128 (compiled for) and 48 (read at run time), with and without
relative keys; float32 at a looser tolerance; dropout's
mask (read back through an identity value matrix) the same in forward and backward; bitwise
equal results on 1 and 2 threads; clear errors. The first test of a session builds the
extension (about a minute) unless the cache has it.
"""

import pytest
import torch

from fairseq_plugins.check_gpu.cases import TILED_GRAPHS, random_tree_graph
from fairseq_plugins.graph_attention import cpu_backend, graph_attention, registry
from fairseq_plugins.graphs.binary_partition import TreeGraphSpec, bpt_graph, causal_step_graph, node_present


@pytest.fixture(scope="module", autouse=True)
def extension():
    try:
        return cpu_backend.load_extension()
    except Exception as error:
        pytest.skip(f"the cpu graph-attention extension does not build here: {error}")


GRAPHS = {
    **TILED_GRAPHS,
    "bpt-k64-n257": (lambda: bpt_graph(257, 64), [257, 100]),
    "bpt-k1-empty-sentence-n17": (lambda: bpt_graph(17, 1), [17, 0]),
}


def leaves(graph, lengths, dtype, dim, heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (len(lengths), heads, graph.num_nodes, dim)
    tensors = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    tensors.append(0.5 * torch.randn(graph.num_edge_types, dim, generator=gen, dtype=torch.float64))
    lengths = torch.tensor(lengths)
    mask = ~node_present(lengths.clamp_min(1), graph.tree.num_tokens)
    mask[lengths == 0] = True  # an empty sentence: no row has a present key
    return [t.to(dtype) for t in tensors], mask


def run(backend, tensors, graph, mask, dropout_p=0.0, grad_seed=1):
    """Output and the gradients of q, k, v, rel_key (None without rel_key)."""
    tensors = [None if t is None else t.detach().requires_grad_() for t in tensors]
    out = graph_attention(*tensors[:3], graph, tensors[3], mask, dropout_p, backend=backend)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed),
                       dtype=torch.float64).to(out.dtype)
    leaves = [t for t in tensors if t is not None]
    grads = list(torch.autograd.grad(out, leaves, grad))
    return [out.detach()] + grads + [None] * (4 - len(leaves))


def assert_close(actual, expected, tolerance):
    for name, a, e in zip(("output", "d q", "d k", "d v", "d rel_key"), actual, expected):
        assert a.shape == e.shape, name
        error = (a.double() - e.double()).abs().max().item()
        limit = tolerance * max(e.abs().max().item(), 1.0)
        assert error <= limit, f"{name}: max error {error:.3g} > {limit:.3g}"


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_float64_matches_the_reference(name):
    build, lengths = GRAPHS[name]
    graph = build()
    dim = {"bpt-k4-n100": 64, "bpt-k2-n17": 128}.get(name, 32)
    tensors, mask = leaves(graph, lengths, torch.float64, dim)
    assert_close(run("cpu", tensors, graph, mask), run("torch", tensors, graph, mask), 1e-10)


def tree_free(graph):
    """The same edges without the tree layout (the torch backend's generic path)."""
    return type(graph)(graph.num_nodes, graph.indptr, graph.indices, graph.edge_type,
                       graph.num_edge_types)


@pytest.mark.parametrize("dim", [48, 64])
def test_a_tree_free_graph_any_head_dim_and_no_relative_keys_match(dim):
    tree_graph = random_tree_graph(60, 5, seed=2)
    tensors, mask = leaves(tree_graph, [60, 31], torch.float64, dim)
    graph = tree_free(tree_graph)
    assert_close(run("cpu", tensors, graph, mask), run("torch", tensors, graph, mask), 1e-10)
    without_rel = [*tensors[:3], None]
    expected = run("torch", without_rel, graph, mask)
    assert expected[-1] is None
    assert_close(run("cpu", without_rel, graph, mask)[:4], expected[:4], 1e-10)


def test_time_first_views_are_read_and_written_in_place():
    """q, k, v as ``split_heads`` views of time-first [N, B, H * D] projections (a layer's
    inputs): the kernel reads their memory, returns a view of a time-first output (so that
    ``merge_heads`` is free) and gradients in that layout; results match the reference."""
    graph = bpt_graph(100, 4)
    tensors, mask = leaves(graph, [100, 37], torch.float64, 32, heads=3)
    time_first = [t.permute(2, 0, 1, 3).contiguous() for t in tensors[:3]]  # [N, B, H, D]
    views = [t.detach().requires_grad_() for t in time_first]
    heads_views = [t.permute(1, 2, 0, 3) for t in views]  # [B, H, N, D], not contiguous
    assert all(cpu_backend.node_major(h).data_ptr() == t.data_ptr() for h, t in zip(heads_views, views))
    out = graph_attention(*heads_views, graph, tensors[3], mask, backend="cpu")
    assert out.permute(2, 0, 1, 3).is_contiguous()
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, views, grad.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3))
    assert all(g.is_contiguous() for g in grads)
    expected = run("torch", tensors, graph, mask)
    assert_close([out.detach(), *[g.permute(1, 2, 0, 3) for g in grads]], expected[:4], 1e-10)


@pytest.mark.parametrize("name", ["bpt-k4-n1000", "random-tree-n40", "bpt-k2-causal-n100"])
def test_float32_matches_the_float64_reference(name):
    build, lengths = GRAPHS[name]
    graph = build()
    tensors, mask = leaves(graph, lengths, torch.float32, 64)
    expected = run("torch", [t.double() for t in tensors], graph, mask)
    assert_close(run("cpu", tensors, graph, mask), expected, 2e-5)


def test_rows_without_present_keys_are_zero_with_zero_gradients():
    graph = bpt_graph(17, 2)
    tensors, mask = leaves(graph, [17, 0], torch.float64, 32)
    out, dq, dk, dv, _ = run("cpu", tensors, graph, mask)
    assert out[1].abs().max() == 0 and dq[1].abs().max() == 0
    assert dk[1].abs().max() == 0 and dv[1].abs().max() == 0


def dropout_mask(tensors, graph, mask, dropout_p, seed):
    """The kept edges of the cpu kernel's dropout after torch.manual_seed(seed), read back
    with an identity value matrix (head dim = nodes): out[u, v] = P[u, v] keep / (1 - p)."""
    q, k, _, rel = tensors
    identity = torch.eye(graph.num_nodes, dtype=q.dtype).expand_as(q).contiguous()
    torch.manual_seed(seed)
    dropped = graph_attention(q, k, identity, graph, rel, mask, dropout_p, backend="cpu")
    probs = graph_attention(q, k, identity, graph, rel, mask, backend="torch")
    edge = probs > 0
    keep = dropped != 0
    assert torch.allclose(dropped[keep], probs[keep] / (1 - dropout_p), rtol=1e-12, atol=0)
    return keep, edge


def test_dropout_uses_the_same_mask_in_forward_and_backward():
    graph, dropout_p, seed = bpt_graph(17, 2), 0.3, 5
    tensors, mask = leaves(graph, [17, 9], torch.float64, graph.num_nodes)
    keep, _ = dropout_mask(tensors, graph, mask, dropout_p, seed)
    torch.manual_seed(seed)
    actual = run("cpu", tensors, graph, mask, dropout_p)
    q, k, v, rel = (t.detach().requires_grad_() for t in tensors)
    identity = torch.eye(graph.num_nodes, dtype=q.dtype).expand_as(q)
    probs = graph_attention(q, k, identity, graph, rel, mask, backend="torch")
    out = (probs * keep / (1 - dropout_p)) @ v
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    expected = [out.detach()] + list(torch.autograd.grad(out, (q, k, v, rel), grad))
    assert_close(actual, expected, 1e-10)


def test_dropout_seeds_differ_and_keep_about_one_minus_p():
    graph, dropout_p = bpt_graph(64, 4), 0.25
    tensors, mask = leaves(graph, [64], torch.float64, graph.num_nodes, heads=1)
    first, edge = dropout_mask(tensors, graph, mask, dropout_p, seed=1)
    second, _ = dropout_mask(tensors, graph, mask, dropout_p, seed=2)
    again, _ = dropout_mask(tensors, graph, mask, dropout_p, seed=1)
    assert torch.equal(first, again) and not torch.equal(first, second)
    kept = first[edge].double().mean().item()
    assert abs(kept - (1 - dropout_p)) < 0.02, kept


def test_results_do_not_depend_on_the_thread_count():
    graph = bpt_graph(1000, 4)
    tensors, mask = leaves(graph, [1000, 600], torch.float32, 64)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            torch.manual_seed(3)
            results.append(run("cpu", tensors, graph, mask, dropout_p=0.1))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bad_inputs_raise_clear_errors(extension):
    graph = bpt_graph(17, 2)
    tensors, mask = leaves(graph, [17], torch.float32, 32)
    assert cpu_backend.refuses(tensors[0].to("meta"), graph) == "CPU tensors only, got meta"
    step = causal_step_graph(TreeGraphSpec("bpt", 2, 2, True), 3)
    q = torch.zeros(1, 2, step.num_nodes, 32)
    kv = torch.zeros(1, 2, step.num_keys, 32)
    with pytest.raises(RuntimeError, match="'cpu' cannot run these inputs: square graphs only"):
        graph_attention(q, kv, kv, step, backend="cpu")
    with pytest.raises(ValueError, match="dropout_p"):
        graph_attention(*tensors[:3], graph, tensors[3], mask, 1.0, backend="cpu")
    q = tensors[0].reshape(-1, graph.num_nodes, 32)
    with pytest.raises(RuntimeError, match="q, k, v must be contiguous"):
        extension.forward(q.transpose(1, 2).contiguous().transpose(1, 2), q, q, None, None,
                          list(graph.on("cpu", torch.int32)), 2, 1.0, 0.0, 0)
    with pytest.raises(RuntimeError, match="contiguous int32"):
        extension.forward(q, q, q, None, None, list(graph.on("cpu")), 2, 1.0, 0.0, 0)


def test_auto_uses_the_kernel_on_cpu_for_any_graph_and_dtype():
    for graph in (bpt_graph(512, 4), bpt_graph(10, 4), tree_free(random_tree_graph(30, 3))):
        q = torch.randn(1, 1, graph.num_nodes, 32)
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            assert registry.DEFAULT.auto(q.to(dtype), graph) == "cpu"
