"""One graph-attention backend on one device, through the public op, against float64.

Which backend and device come from the environment, so that ``check_gpu`` runs this module
once per backend, each in its own process (an illegal memory access in one breaks only its
own CUDA context):

    FAIRSEQ_PLUGINS_CHECK_BACKEND=triton python -m pytest --pyargs fairseq_plugins.check_gpu.gpu_tests.test_backend

``FAIRSEQ_PLUGINS_CHECK_DEVICE`` (default ``cuda``) and ``FAIRSEQ_PLUGINS_CHECK_SIZE``
(``full``, default, or ``small``: the cases compute-sanitizer and CPU runs can afford).
Covers every dtype and head dim on BPT (k 1/2/4/8, causal), SegTree, random tree-laid and
random CSR graphs, padding, every tree length up to 2048, 8192 and 16384 tokens in half
precision, dropout, rows without keys and, for the backends that promise it, bit-identical
backward passes.
"""

import os

import pytest
import torch

from fairseq_plugins.check_gpu import kernel_checks
from fairseq_plugins.check_gpu.cases import TILED_GRAPHS, random_graph
from fairseq_plugins.graph_attention import graph_attention
from fairseq_plugins.graphs.binary_partition import bpt_graph, segtree_graph

BACKEND = os.environ.get("FAIRSEQ_PLUGINS_CHECK_BACKEND", "triton")
DEVICE = os.environ.get("FAIRSEQ_PLUGINS_CHECK_DEVICE", "cuda")
SMALL = os.environ.get("FAIRSEQ_PLUGINS_CHECK_SIZE", "full") == "small"

# what the backends promise beyond the op itself
NO_DROPOUT = {"flex"}
BIT_REPRODUCIBLE = {"cuda", "cpu", "torch", "triton"}  # no atomics in their backward
KERNEL_HEAD_DIMS = {"triton": (32, 64, 128), "cuda": (32, 64, 128)}

GRAPHS = {**TILED_GRAPHS, "random-n300": (lambda: random_graph(300, 12, 9), [300, 300])}
SMALL_GRAPHS = ("bpt-k1-n1", "bpt-k1-n3", "bpt-k2-n17", "bpt-k2-causal-n100", "segtree-n64",
                "random-tree-n40")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
if SMALL:
    GRAPHS = {name: GRAPHS[name] for name in SMALL_GRAPHS}
    DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEAD_DIMS = (32,) if SMALL else (32, 64, 128)
TREE_LENGTHS = (1, 2, 3, 5, 17) if SMALL else (1, 2, 3, 5, 17, 100, 513, 2048)
TREES = {"bpt-k1": lambda n: bpt_graph(n, 1), "bpt-k4": lambda n: bpt_graph(n, 4),
         "bpt-k4-causal": lambda n: bpt_graph(n, 4, causal=True), "segtree": segtree_graph}
LONG = () if SMALL else ((8192, 4), (16384, 4), (16384, 1))


def unavailable() -> str:
    """Why ``BACKEND`` cannot run on ``DEVICE`` (empty when it can)."""
    if torch.device(DEVICE).type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    graph = bpt_graph(2, 1)
    q = torch.zeros(1, 1, graph.num_nodes, HEAD_DIMS[0], device=DEVICE)
    try:
        graph_attention(q, q, q, graph, backend=BACKEND)
    except ValueError as error:  # not registered: its module could not be imported
        return str(error)
    except RuntimeError as error:
        if "cannot run" in str(error):
            return str(error)
        raise
    return ""


REASON = unavailable()
pytestmark = pytest.mark.skipif(bool(REASON), reason=f"{BACKEND} on {DEVICE}: {REASON}")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("name", GRAPHS)
def test_forward_and_gradients_match_float64(name, dim, dtype):
    build, lengths = GRAPHS[name]
    kernel_checks.check_against_float64(BACKEND, build(), lengths, dtype, dim, DEVICE)


@pytest.mark.parametrize("n", TREE_LENGTHS)
@pytest.mark.parametrize("tree", TREES)
def test_every_tree_length(tree, n):
    kernel_checks.check_against_float64(BACKEND, TREES[tree](n), [n, max(1, n // 3)],
                                        torch.float32, 64 if not SMALL else 32, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n,k", LONG)
def test_long_documents_in_half_precision(n, k, dtype):
    kernel_checks.check_against_float64(BACKEND, bpt_graph(n, k), [n - 5], dtype, 64, DEVICE,
                                        heads=1)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_dropout(dtype):
    build, lengths = GRAPHS["bpt-k2-n17" if SMALL else "bpt-k4-n257"]
    if BACKEND in NO_DROPOUT:
        with pytest.raises(ValueError, match="dropout"):
            kernel_checks.check_dropout(BACKEND, build(), lengths, dtype, HEAD_DIMS[-1], DEVICE)
        return
    kernel_checks.check_dropout(BACKEND, build(), lengths, dtype, HEAD_DIMS[-1], DEVICE)


def test_rows_without_present_keys_give_zeros():
    kernel_checks.check_rows_without_keys(BACKEND, bpt_graph(50, 2), torch.float32, HEAD_DIMS[0],
                                          DEVICE)


def test_backward_is_bit_reproducible():
    if BACKEND not in BIT_REPRODUCIBLE:
        pytest.skip(f"{BACKEND} does not promise a bit-reproducible backward")
    graph = bpt_graph(17 if SMALL else 1000, 4)
    dtype = torch.float16 if torch.device(DEVICE).type == "cuda" else torch.float32
    leaves, mask = kernel_checks.make_inputs(graph, [graph.tree.num_tokens, 7], dtype, HEAD_DIMS[-1])
    grad_out = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(3))
    first = kernel_checks.run(BACKEND, graph, leaves, mask, grad_out, DEVICE, dtype)
    for _ in range(3):
        again = kernel_checks.run(BACKEND, graph, leaves, mask, grad_out, DEVICE, dtype)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_unsupported_head_dims_are_refused():
    dims = KERNEL_HEAD_DIMS.get(BACKEND)
    if dims is None:
        pytest.skip(f"{BACKEND} takes every head dim")
    graph = bpt_graph(8, 1)
    q = torch.zeros(1, 1, graph.num_nodes, 48, device=DEVICE)
    with pytest.raises(RuntimeError, match="cannot run"):
        graph_attention(q, q, q, graph, backend=BACKEND)
