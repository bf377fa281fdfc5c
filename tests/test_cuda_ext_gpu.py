"""The fused CUDA kernels against the torch backend (float64), on a GPU; skipped without one.

Covers float32/float16/bfloat16, head dims 32/64/128, random graphs (empty rows, masked keys,
multi-type rows split across warps) and real BPT/SegTree graphs from 1 to 16384 tokens,
forward and all gradients, dropout (against a reference that regenerates the kernels' keep
mask), bit-exact repeatability of backward, and the "auto" self-check on the real kernels.
``python -m fairseq_plugins.check_gpu`` runs these, compute-sanitizer and the benchmark.
The same kernels run on the CPU in every CI run: tests/test_cuda_ext_emulation.py.
"""

import pytest
import torch

from fairseq_plugins.graph_attention import cuda_backend, flex_backend, registry  # noqa: F401
from fairseq_plugins.graph_attention.registry import graph_attention
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present, segtree_graph
from tests.cuda_ext_reference import (assert_close, check_against_torch, check_dropout,
                                      random_graph, run)


def gpu(test):
    """Marks a test as needing a GPU, and skips it without one."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(test))


def make_inputs(graph, batch, heads, dim, dtype, padded_lengths=None, seed=0):
    torch.manual_seed(seed)
    shape = (batch, heads, graph.num_nodes, dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    rel = 0.5 * torch.randn(graph.num_edge_types, dim, device="cuda", dtype=dtype)
    if padded_lengths is not None:  # real tree padding: spans over padding are absent
        kpm = ~node_present(torch.tensor(padded_lengths), graph.tree.num_tokens).cuda()
    else:
        kpm = torch.rand(batch, graph.num_nodes, device="cuda") < 0.2
    return [q, k, v, rel], kpm


def cuda_attention(graph, kpm, split_edges=cuda_backend.SPLIT_EDGES):
    return lambda q, k, v, r: cuda_backend.fused_graph_attention(
        cuda_backend.load_extension(), q, k, v, graph, r, kpm, split_edges=split_edges)


def check(graph, batch, heads, dim, dtype, padded_lengths=None,
          split_edges=cuda_backend.SPLIT_EDGES):
    leaves, kpm = make_inputs(graph, batch, heads, dim, dtype, padded_lengths)
    check_against_torch(cuda_attention(graph, kpm, split_edges), graph, leaves, kpm, dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("split_edges", [7, cuda_backend.SPLIT_EDGES])
def test_random_graphs_all_dtypes_and_head_dims(dtype, dim, split_edges):
    check(random_graph(300, 12, 9), batch=2, heads=3, dim=dim, dtype=dtype,
          split_edges=split_edges)


@gpu
@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 100, 513, 2048])
@pytest.mark.parametrize("builder", ["bpt1", "bpt4", "bpt4_causal", "segtree"])
def test_tree_graphs(builder, n):
    graph = {"bpt1": lambda: bpt_graph(n, 1), "bpt4": lambda: bpt_graph(n, 4),
             "bpt4_causal": lambda: bpt_graph(n, 4, causal=True),
             "segtree": lambda: segtree_graph(n)}[builder]()
    check(graph, batch=2, heads=2, dim=64, dtype=torch.float32,
          padded_lengths=[n, max(1, n // 3)])


@gpu
@pytest.mark.parametrize("n,k", [(8192, 4), (16384, 4), (16384, 1)])
def test_long_tree_graphs_half_precision(n, k):
    check(bpt_graph(n, k), batch=1, heads=2, dim=64, dtype=torch.float16, padded_lengths=[n - 5])


@gpu
def test_rows_without_present_keys_give_zeros():
    graph = random_graph(50, 4, 3)
    (q, k, v, rel), _ = make_inputs(graph, 2, 2, 32, torch.float32)
    kpm = torch.ones(2, 50, dtype=torch.bool, device="cuda")
    kpm[0, :10] = False
    out, dq, dk, dv, _ = run(cuda_attention(graph, kpm, 3), [q, k, v, rel], torch.randn_like(q))
    assert torch.isfinite(out).all() and out[1].abs().max() == 0 and dq[1].abs().max() == 0
    assert dk[:, :, 10:].abs().max() == 0 and dv[:, :, 10:].abs().max() == 0


@gpu
def test_backward_is_bit_reproducible():
    graph = bpt_graph(1000, 4)
    leaves, kpm = make_inputs(graph, 2, 4, 64, torch.float16, padded_lengths=[1000, 700])
    grad_out = torch.randn_like(leaves[0])
    attention = cuda_attention(graph, kpm, 32)  # many split rows: merges in a fixed order
    first = run(attention, leaves, grad_out)
    for _ in range(3):
        again = run(attention, leaves, grad_out)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@gpu
def test_flex_backend_forward_and_gradients():
    graph = bpt_graph(700, 4)
    leaves, kpm = make_inputs(graph, 2, 2, 64, torch.float32, padded_lengths=[700, 300])
    grad_out = torch.randn_like(leaves[0])
    expected = run(lambda q, k, v, r: graph_attention(q, k, v, graph, r, kpm, backend="torch"),
                   leaves, grad_out, torch.float64)
    actual = run(lambda q, k, v, r: graph_attention(q, k, v, graph, r, kpm, backend="flex"),
                 leaves, grad_out)
    for name, a, e in zip(("out", "dq", "dk", "dv", "drel"), actual, expected):
        assert_close(a, e, torch.float32, f"flex {name}", tolerance=1e-4)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_matches_regenerated_mask(dtype):
    graph = bpt_graph(300, 2)
    (q, k, v, rel), kpm = make_inputs(graph, 2, 2, 64, dtype, padded_lengths=[300, 200])
    check_dropout(cuda_backend.load_extension(), graph, q, k, v, rel, kpm, 0.3, split_edges=16)


# ------------------------------------------------------------------- selection and errors

@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_auto_passes_the_self_check_and_falls_back_for_other_head_dims(dtype, monkeypatch):
    monkeypatch.setattr(registry, "_SELF_CHECKS", {})
    graph = bpt_graph(64, 2)
    fast = "triton" if "triton" in registry._BACKENDS else "cuda"  # triton comes first when installed
    for dim, expected in ((64, fast), (48, "torch")):
        q = torch.randn(1, 2, graph.num_nodes, dim, device="cuda", dtype=dtype)
        assert registry.auto_backend(q, graph) == expected
    assert registry._SELF_CHECKS[(fast, "cuda:0", dtype, 64, dtype)] is None


@gpu
def test_bad_inputs_raise_clear_errors():
    graph = bpt_graph(40, 1)
    q = torch.randn(1, 2, graph.num_nodes, 64, device="cuda")
    with pytest.raises(ValueError, match="dropout_p"):
        cuda_backend.cuda_graph_attention(q, q, q, graph, dropout_p=1.0)
    with pytest.raises(RuntimeError, match="head dim"):
        cuda_backend.cuda_graph_attention(q[..., :48], q[..., :48], q[..., :48], graph)
    with pytest.raises(RuntimeError, match="same shape|dtype"):
        cuda_backend.cuda_graph_attention(q, q.half(), q, graph)
