"""The CUDA kernels run on the CPU (host emulation, tests/cuda_ext_emulation.py) against the
float64 torch backend: every dtype and head dim, padding, split rows, dropout, forward and
every gradient. Small graphs: an emulated warp costs tens of microseconds per shuffle."""

import pytest
import torch

from fairseq_plugins.check_gpu.cases import random_graph
from fairseq_plugins.graph_attention import cuda_backend, registry
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present, segtree_graph
from tests.cuda_ext_emulation import load_emulation
from tests.cuda_ext_reference import check_against_torch, check_dropout, run

# rows longer than this are split across warps in these tests (the default is 256)
SPLIT = 4


@pytest.fixture(scope="module")
def emulation():
    return load_emulation()


def inputs(graph, dim, dtype=torch.float32, lengths=None, batch=2, heads=2, seed=0):
    """q, k, v, rel_key (float32) and a key padding mask from real tree padding or random."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, heads, graph.num_nodes, dim)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    rel = 0.5 * torch.randn(graph.num_edge_types, dim, generator=gen)
    if lengths is not None:
        kpm = ~node_present(torch.tensor(lengths), graph.tree.num_tokens)
    else:
        kpm = torch.rand(batch, graph.num_nodes, generator=gen) < 0.2
    return [t.to(dtype) for t in (q, k, v, rel)], kpm


def fused(graph, kpm, split=SPLIT, dropout_p=0.0):
    """The backend's glue and ops, their CPU kernel being the emulation (fixture)."""
    return lambda q, k, v, r: cuda_backend.fused_graph_attention(
        q, k, v, graph, r, kpm, dropout_p, seed=registry.dropout_seed(q.device, dropout_p), split_edges=split)


@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_dtype_and_head_dim_on_a_padded_bpt_graph(emulation, dtype, dim):
    graph = bpt_graph(12, 1)  # the root and level-3 rows (8+ edges) are split at SPLIT = 4
    leaves, kpm = inputs(graph, dim, lengths=[12, 5])
    check_against_torch(fused(graph, kpm), graph, leaves, kpm, dtype)


@pytest.mark.parametrize("split", [SPLIT, cuda_backend.SPLIT_EDGES])
@pytest.mark.parametrize("builder", ["bpt2_causal", "segtree", "random", "random_300_types"])
def test_graphs_with_and_without_split_rows(emulation, builder, split):
    graph = {"bpt2_causal": lambda: bpt_graph(11, 2, causal=True),
             "segtree": lambda: segtree_graph(9),
             # multi-type rows split across warps, empty rows, random padding
             "random": lambda: random_graph(24, 5, 4),
             # rows whose types span several type windows of the dQ kernel
             "random_300_types": lambda: random_graph(24, 8, 300)}[builder]()
    lengths = None if graph.tree is None else [graph.tree.num_tokens, 4]
    leaves, kpm = inputs(graph, 32, lengths=lengths)
    check_against_torch(fused(graph, kpm, split), graph, leaves, kpm, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_matches_the_regenerated_mask(emulation, dtype):
    graph = bpt_graph(10, 2)
    (q, k, v, rel), kpm = inputs(graph, 32, dtype, lengths=[10, 6])
    check_dropout(graph, q, k, v, rel, kpm, 0.3, split_edges=SPLIT)


def test_rows_without_present_keys_give_zeros(emulation):
    graph = random_graph(20, 4, 3)
    (q, k, v, rel), _ = inputs(graph, 32)
    kpm = torch.ones(2, 20, dtype=torch.bool)
    kpm[0, :6] = False
    out, dq, dk, dv, _ = run(fused(graph, kpm), [q, k, v, rel], torch.randn_like(q))
    assert torch.isfinite(out).all() and out[1].abs().max() == 0 and dq[1].abs().max() == 0
    assert dk[:, :, 6:].abs().max() == 0 and dv[:, :, 6:].abs().max() == 0


def test_bad_inputs_raise_clear_errors(emulation):
    graph = bpt_graph(6, 1)
    (q, k, v, rel), kpm = inputs(graph, 32)
    with pytest.raises(RuntimeError, match="head dim"):
        cuda_backend.fused_graph_attention(q[..., :16], k[..., :16], v[..., :16], graph)
    with pytest.raises(RuntimeError, match="dtype"):
        cuda_backend.fused_graph_attention(q, k.half(), v, graph)
    with pytest.raises(ValueError, match="dropout_p"):
        cuda_backend.fused_graph_attention(q, k, v, graph, dropout_p=1.0)
    with pytest.raises(ValueError, match="dropout needs the op's seed tensor"):
        cuda_backend.fused_graph_attention(q, k, v, graph, dropout_p=0.1)
