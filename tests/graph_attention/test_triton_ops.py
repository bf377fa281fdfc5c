"""The triton backend's kernels as ``torch.library`` ops, under the Triton interpreter (CPU).

``opcheck`` of both ops (schema, fake implementations, autograd registration, tracing);
``torch.compile(fullgraph=True)`` of a BPT layer and of the op with dropout matches eager,
forward and gradients; the dropout seed is a tensor drawn on the query's device from torch's
generator with no host read, and the backward regenerates the forward's mask.
"""

import pytest
import torch
from fairseq.models.transformer import TransformerConfig
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")
from fairseq_plugins.graph_attention import graph_attention, tile_plan, triton_backend  # noqa: E402
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present  # noqa: E402
from fairseq_plugins.modules.bpt.graph_transformer_layers import GraphEncoderLayer  # noqa: E402
from tests.compile_support import needs_traceable_op  # noqa: E402
from tests.graph_attention.test_graph_attention_compile import assert_compiled_layer_matches_eager  # noqa: E402
from tests.graph_attention.test_triton_backend import (  # noqa: E402
    assert_close, dense_reference, inputs, keep_mask,
)

from tests.triton_interpreter import skip_reason  # noqa: E402

pytestmark = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason())


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _op_arguments(graph, with_rel, dropout_p=0.0, bh=2, dim=32):
    """Arguments of ``forward_op`` for random inputs over ``graph`` (one head per sentence)."""
    gen = torch.Generator().manual_seed(0)
    # built here, not cached on the graph (bpt_graph is shared: other tests plan it otherwise)
    plan = tile_plan.build_plan(graph, *triton_backend.tiles(torch.float32, dim))
    q, k, v = (torch.randn(bh, 1, graph.num_nodes, dim, generator=gen, requires_grad=True) for _ in range(3))
    rel = torch.randn(graph.num_edge_types, dim, generator=gen, requires_grad=True) if with_rel else None
    pad = (~node_present(torch.tensor([graph.tree.num_tokens] + [3] * (bh - 1)),
                         graph.tree.num_tokens)).to(torch.uint8)
    seed = torch.tensor(1234, dtype=torch.int64)
    return (q, k, v, rel, pad, list(plan.tensors()), list(plan.sizes()), dim ** -0.5, dropout_p, seed)


@pytest.mark.parametrize("with_rel", [True, False], ids=["rel_key", "no_rel_key"])
def test_the_ops_pass_opcheck(with_rel):
    """Schema, fake implementations against the real kernels, the autograd registration and
    ahead-of-time dispatch, for the forward op (dropout on: the seed is an input) and the
    backward op. Split blocks, so that the merges run inside the ops."""
    graph = bpt_graph(40, 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tile_plan, "TILES_PER_ITEM", 1)
        plan = tile_plan.build_plan(graph, *triton_backend.tiles(torch.float32, 32))
    assert plan.query_work.num_parts and plan.key_work.num_parts
    args = list(_op_arguments(graph, with_rel, dropout_p=0.2))
    args[5], args[6] = list(plan.tensors()), list(plan.sizes())
    torch.library.opcheck(torch.ops.fairseq_plugins.triton_graph_attention.default, tuple(args))
    out, lse, table = triton_backend.forward_op(*args)
    q, k, v, rel = args[:4]
    grad = torch.randn_like(out)
    torch.library.opcheck(torch.ops.fairseq_plugins.triton_graph_attention_backward.default,
                          (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                           None if rel is None else rel.detach(), table.detach(),
                           *args[4:]))


def test_the_fake_implementations_give_the_real_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    graph = bpt_graph(8, 2)
    args = _op_arguments(graph, True)
    real = triton_backend.forward_op(*args)
    real_grads = triton_backend.backward_op(real[0], *(a.detach() for a in args[:3]), real[0], real[1],
                                            args[3].detach(), real[2], *args[4:])
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = triton_backend.forward_op(*args)
        fake_grads = triton_backend.backward_op(fake[0], *args[:3], fake[0], fake[1], args[3], fake[2],
                                                *args[4:])
    for r, f in zip(real + real_grads, fake + fake_grads):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_the_fake_implementations_give_the_strides_of_time_first_outputs():
    """Time-first q, k, v (fairseq's layout) get time-first outputs and gradients; the fake
    implementations say so (``torch.compile`` plans the downstream views with them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    graph = bpt_graph(8, 2)
    q, k, v, *rest = _op_arguments(graph, True)
    q, k, v = (x.detach().permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3).requires_grad_()
               for x in (q, k, v))
    args = (q, k, v, *rest)
    real = triton_backend.forward_op(*args)
    real_grads = triton_backend.backward_op(real[0], q, k, v, real[0], real[1], rest[0].detach(), real[2],
                                            *rest[1:])
    assert real[0].stride() == q.stride() and real_grads[0].stride() == q.stride()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = triton_backend.forward_op(*args)
        fake_grads = triton_backend.backward_op(fake[0], q, k, v, fake[0], fake[1], rest[0], fake[2], *rest[1:])
    for r, f in zip(real + real_grads, fake + fake_grads):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def _bpt_layer(num_edge_types):
    """One head of 32: a head dim the kernels have."""
    cfg = TransformerConfig()
    cfg.encoder.embed_dim, cfg.encoder.ffn_embed_dim, cfg.encoder.attention_heads = 32, 32, 1
    cfg.attention_dropout, cfg.dropout = 0.0, 0.0
    torch.manual_seed(0)
    return GraphEncoderLayer(cfg, num_edge_types, backend="triton")


@needs_traceable_op
def test_a_compiled_bpt_layer_matches_eager_forward_and_gradients():
    tokens = 20
    graph = bpt_graph(tokens, 2)
    layer = _bpt_layer(graph.num_edge_types)
    assert_compiled_layer_matches_eager(layer, graph, tokens, 32)


DROPOUT = 0.3


def _dropout_case():
    graph = bpt_graph(24, 2)
    (q, k, v, rel), ref, mask = inputs(graph, [24, 13], torch.float32)
    return graph, (q, k, v, rel), ref, mask


def _attend(graph, mask):
    def attend(q, k, v, rel):
        return graph_attention(q, k, v, graph, rel, mask, DROPOUT, backend="triton")
    return attend


@needs_traceable_op
def test_compiled_dropout_draws_a_new_mask_per_call_and_regenerates_it_in_the_backward():
    """Compiled as in eager: the seed is the first draw of torch's generator (the mask the
    kernels hash from it, rebuilt in torch, gives the float64 reference, forward and every
    gradient); a second call draws another mask; ``torch.manual_seed`` reproduces it."""
    graph, low, ref, mask = _dropout_case()
    compiled = torch.compile(_attend(graph, mask), fullgraph=True, backend="aot_eager")
    torch.manual_seed(7)
    first = compiled(*low)
    second = compiled(*low)
    torch.manual_seed(7)
    again = compiled(*low)
    torch.manual_seed(7)
    eager = _attend(graph, mask)(*low)
    assert not torch.equal(first, second)
    assert torch.equal(first, again) and torch.equal(first, eager)

    torch.manual_seed(7)
    seed = int(torch.randint(0, 2**31 - 1, ()))
    keep = keep_mask(seed, 2, graph.num_nodes, DROPOUT)
    scale = 32 ** -0.5
    expected = dense_reference(*ref[:3], graph, ref[3], mask, scale, keep, DROPOUT)
    assert_close(first, expected, torch.float32, "output")
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    for name, actual, wanted in zip(("q", "k", "v", "rel_key"), torch.autograd.grad(first, low, grad),
                                    torch.autograd.grad(expected, ref, grad.double())):
        assert_close(actual, wanted, torch.float32, f"grad {name}")


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value on the host (``.item()``, ``int()``, ``float()``,
    ``bool()``: ``aten._local_scalar_dense``), a device sync on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_dropout_reads_nothing_on_the_host_and_draws_its_seed_on_the_query_device(monkeypatch):
    graph, low, _, mask = _dropout_case()
    seeds = []
    forward = triton_backend.forward_op

    def recording(*args):
        seeds.append(args[-1])
        return forward(*args)
    monkeypatch.setattr(triton_backend, "forward_op", recording)
    _attend(graph, mask)(*low)  # the plan is built once, outside the count
    with HostReads() as reads:
        out = _attend(graph, mask)(*low)
        out.sum().backward()
    assert reads.count == 0
    assert all(s.device == low[0].device and s.dtype == torch.int64 and s.shape == (2,) for s in seeds)
    with HostReads() as reads:  # the counter sees a host read
        int(seeds[-1][0])
    assert reads.count == 1


def test_the_split_block_merges_launch_on_grids_of_the_plans_shapes(monkeypatch):
    """What capturing a CUDA graph needs, with split query and key blocks: a forward +
    backward reads nothing on the host, and every merge kernel's grid is (the plan's split
    blocks, sentences x heads), never a size read from the data."""
    launches = []
    launch = triton_backend._launch

    def recording(name, grid, *args):
        launches.append((name, grid))
        return launch(name, grid, *args)
    monkeypatch.setattr(triton_backend, "_launch", recording)
    monkeypatch.setattr(tile_plan, "TILES_PER_ITEM", 2)
    graph = bpt_graph.__wrapped__(40, 1)  # a fresh graph: its plan is built with these splits
    (q, k, v, rel), _, mask = inputs(graph, [40, 23], torch.float32, heads=2)
    graph_attention(q, k, v, graph, rel, mask, backend="triton")  # the plan is built once, outside the count
    plan = tile_plan.plan_on(graph, *triton_backend.tiles(torch.float32, 32), "cpu")
    assert plan.query_work.num_parts and plan.key_work.num_parts
    launches.clear()
    with HostReads() as reads:
        graph_attention(q, k, v, graph, rel, mask, backend="triton").sum().backward()
    assert reads.count == 0
    merges = [(name, grid) for name, grid in launches if name in triton_backend.MERGE_KERNELS]
    split = plan.query_work.part_index.size(0), plan.key_work.part_index.size(0)
    assert merges == [("merge_forward", (split[0], 4)), ("merge_grad_q", (split[0], 4)),
                      ("merge_grad_kv", (split[1], 4))]


def test_the_glue_count_steps_into_the_ops(monkeypatch):
    """``scripts/triton_work_model.py`` counts the PyTorch ops inside the two ops, not the two
    ops as two: 4 around the 6 Triton launches of a forward + backward without split blocks
    (``docs/cuda_ext.md``), with a bf16 rel_key (its fp32 copy in the forward and in the
    backward, the zeros of the per-(row, type) sums, the cast of its gradient), on q, k, v
    as fairseq's attention hands them over (views of time-first projections), which go into
    the kernels without a copy (28 ops while the op made them contiguous). With split blocks
    the same 4 ops: the merges are 3 more Triton launches, no glue (57 ops at 1,100 tokens
    while they were PyTorch ops). 9 while the relative-key table and d rel_key were GEMMs
    around the kernels (q cast to fp32 for each) and the sums fp32 atomics."""
    from scripts import triton_work_model

    glue = triton_work_model.count_glue(100, 32)
    assert (glue["ops"], glue["launches"], glue["syncs"]) == (4, 6, 0)
    assert glue["names"] == ["to", "zeros"]
    assert not {"triton_graph_attention", "triton_graph_attention_backward"} & set(glue["names"])
    assert not glue["merges"]

    monkeypatch.setattr(tile_plan, "TILES_PER_ITEM", 1)
    monkeypatch.setattr(triton_work_model, "bpt_graph", bpt_graph.__wrapped__)  # fresh: split plans
    split = triton_work_model.count_glue(40, 32)
    assert (split["ops"], split["launches"], split["syncs"], split["names"]) == (4, 9, 0, glue["names"])
    assert split["merges"] == ["merge_forward_kernel", "merge_grad_q_kernel", "merge_grad_kv_kernel"]
    assert all(per_pair > 0 for _, per_pair in split["merge_bytes"])  # parts per (sentence, head)
