"""CPU checks of the optional graph-attention backends: flex (forward; its gradients through
eager flex's reference backward; the compiled path's shapes) and cuda registration."""

import pytest
import torch

from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present, segtree_graph
from fairseq_plugins.graph_attention import AttentionGraph, cuda_backend, flex_backend, graph_attention

# eager flex on CPU is the unfused reference path; its advice to compile is expected here
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _inputs(graph, batch=2, heads=2, dim=16, seed=0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, graph.num_nodes, dim, dtype=torch.float64)
               for _ in range(3))
    return q, k, v, torch.randn(graph.num_edge_types, dim, dtype=torch.float64)


@pytest.mark.parametrize("graph", [bpt_graph(13, 1), bpt_graph(150, 4, causal=True),
                                   segtree_graph(40)], ids=["bpt1", "bpt4-causal", "segtree"])
def test_flex_forward_matches_torch_backend(graph):
    q, k, v, rel = _inputs(graph)
    n = graph.tree.num_tokens
    kpm = ~node_present(torch.tensor([n, max(1, n // 2)]), n)
    for rel_key, mask in ((rel, kpm), (None, None)):
        torch.testing.assert_close(
            graph_attention(q, k, v, graph, rel_key, mask, backend="flex"),
            graph_attention(q, k, v, graph, rel_key, mask, backend="torch"))


def test_flex_rows_without_present_keys_are_zero():
    graph = bpt_graph(20, 1)
    q, k, v, rel = _inputs(graph)
    kpm = torch.zeros(2, graph.num_nodes, dtype=torch.bool)
    kpm[1] = True
    out = graph_attention(q, k, v, graph, rel, kpm, backend="flex")
    assert out[1].abs().max() == 0 and out[0].abs().min() > 0


def test_flex_block_structure_covers_exactly_the_edges():
    graph = bpt_graph(300, 2)  # 600 nodes: 5 blocks of 128, the last one partial
    blocks = flex_backend.graph_blocks(graph, "cpu")
    types = torch.full((5 * 128, 5 * 128), -1, dtype=torch.int64)
    for qb in range(5):
        for slot in range(int(blocks.kv_num_blocks[0, 0, qb])):
            kb = int(blocks.kv_indices[0, 0, qb, slot])
            tile = blocks.type_tiles[blocks.tile_of_block[qb, kb]]
            types[qb * 128:(qb + 1) * 128, kb * 128:(kb + 1) * 128] = tile
    expected = torch.full_like(types, -1)
    expected[graph.rows(), graph.indices] = graph.edge_type
    assert torch.equal(types, expected)


def test_flex_rejects_dropout():
    graph = bpt_graph(10, 1)
    q, k, v, _ = _inputs(graph)
    with pytest.raises(RuntimeError, match="'flex' cannot run these inputs: flex_attention has no attention dropout "
                                           r"\(auto uses another backend\)"):
        graph_attention(q, k, v, graph, dropout_p=0.1, backend="flex")


def test_flex_gradients_match_float64(monkeypatch):
    """torch 2.13 refuses flex's backward on CPU only by a device check: past it, eager flex
    differentiates the mask and score functions (relative keys included) by its reference
    backward, which checks what the compiled backward on a GPU is given."""
    import torch.nn.attention.flex_attention as flex_module
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    graph = bpt_graph(40, 2)
    leaves = _inputs(graph)
    kpm = ~node_present(torch.tensor([40, 17]), 40)
    grad = torch.randn(2, 2, graph.num_nodes, 16, dtype=torch.float64)
    results = []
    for backend in ("flex", "torch"):
        tensors = [t.clone().requires_grad_() for t in leaves]
        graph_attention(*tensors[:3], graph, tensors[3], kpm, backend=backend).backward(grad)
        results.append([t.grad for t in tensors])
    for flex_grad, torch_grad in zip(*results):
        torch.testing.assert_close(flex_grad, torch_grad)


def test_flex_tiles_use_compact_types():
    blocks = flex_backend.graph_blocks(bpt_graph(300, 4), "cpu")
    assert blocks.kv_num_blocks.dtype == blocks.kv_indices.dtype == blocks.tile_of_block.dtype == torch.int32
    assert blocks.type_tiles.dtype == torch.int8
    assert [flex_backend.edge_type_dtype(n) for n in (1, 127, 128, 32767, 32768)] == \
        [torch.int8, torch.int8, torch.int16, torch.int16, torch.int32]


def test_flex_compiled_path_compiles_once_per_size_bucket(monkeypatch):
    """The compiled path (what CUDA runs), compiled on CPU by aot_eager (dynamo decides what
    recompiles, whatever compiles): graphs of one size bucket share a compile across lengths
    and batch sizes, and match float64."""
    import torch._dynamo
    monkeypatch.setattr(flex_backend, "COMPILED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(flex_backend, "COMPILER", "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []
    for tokens, batch in ((40, 2), (70, 2), (100, 3), (120, 4), (130, 2), (200, 5)):
        graph = bpt_graph(tokens, 2)
        q, k, v, rel = _inputs(graph, batch=batch, seed=tokens)
        kpm = ~node_present(torch.tensor([tokens] * (batch - 1) + [tokens // 2]), tokens)
        torch.testing.assert_close(graph_attention(q.float(), k.float(), v.float(), graph, rel.float(), kpm,
                                                   backend="flex").double(),
                                   graph_attention(q, k, v, graph, rel, kpm, backend="torch"), atol=1e-5, rtol=1e-5)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # bucket 256 (81-241 nodes): the first graph, a recompile when the edge-tile count
    # first changes, one when the batch size does, then none; bucket 512 (265, 403 nodes): one
    assert graphs == [1, 2, 3, 3, 4, 4]
    torch._dynamo.reset()


def test_cpu_tensors_use_the_torch_backend_and_forcing_cuda_fails_clearly():
    graph = AttentionGraph(num_nodes=3, indptr=torch.tensor([0, 1, 2, 3]),
                           indices=torch.tensor([0, 1, 2]), edge_type=torch.zeros(3, dtype=torch.long),
                           num_edge_types=1)
    q = torch.randn(1, 1, 3, 32)
    torch.testing.assert_close(graph_attention(q, q, q, graph), q)  # self-loops only
    assert cuda_backend.refuses(q, graph) == "CUDA tensors only, got cpu"
    with pytest.raises(RuntimeError, match="'cuda' cannot run these inputs: CUDA tensors only"):
        graph_attention(q, q, q, graph, backend="cuda")
