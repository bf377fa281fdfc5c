"""CPU checks of the optional graph-attention backends: flex (forward) and cuda registration."""

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
    with pytest.raises(RuntimeError, match="'flex' cannot run these inputs: flex_attention has no attention dropout"):
        graph_attention(q, k, v, graph, dropout_p=0.1, backend="flex")


def test_cpu_tensors_use_the_torch_backend_and_forcing_cuda_fails_clearly():
    graph = AttentionGraph(num_nodes=3, indptr=torch.tensor([0, 1, 2, 3]),
                           indices=torch.tensor([0, 1, 2]), edge_type=torch.zeros(3, dtype=torch.long),
                           num_edge_types=1)
    q = torch.randn(1, 1, 3, 32)
    torch.testing.assert_close(graph_attention(q, q, q, graph), q)  # self-loops only
    assert cuda_backend.refuses(q, graph) == "CUDA tensors only, got cpu"
    with pytest.raises(RuntimeError, match="'cuda' cannot run these inputs: CUDA tensors only"):
        graph_attention(q, q, q, graph, backend="cuda")
