"""The CUDA backend's kernels as ``torch.library`` ops, on CPU: their fake implementations on
the meta device, ``opcheck`` and ``torch.compile(fullgraph=True)`` with the host emulation as
the ops' CPU kernel (tests/cuda_ext_emulation.py), the dropout (seed, offset) as a tensor
drawn on the query's device (new mask per draw, reproduced by ``torch.manual_seed``, no host
read), and every launch inside a device guard."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_plugins.graph_attention import cuda_backend, registry
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present
from tests.compile_support import needs_traceable_op
from tests.cuda_ext_emulation import load_emulation
from tests.cuda_ext_reference import check_dropout, run

SPLIT = 4  # rows longer than this are split: the merge kernels run too
GRAPH = bpt_graph(10, 2)


@pytest.fixture(scope="module")
def emulation():
    return load_emulation()


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(dtype=torch.float32, dim=32, requires_grad=False, device="cpu", strided=False):
    """q, k, v [B, H, N, D] (``strided``: views of [N, B, H, D], as a layer's projections
    give), rel_key and a padding mask."""
    gen = torch.Generator().manual_seed(0)
    if strided:
        q, k, v = (torch.randn(GRAPH.num_nodes, 2, 2, dim, generator=gen).permute(1, 2, 0, 3) for _ in range(3))
    else:
        q, k, v = (torch.randn(2, 2, GRAPH.num_nodes, dim, generator=gen) for _ in range(3))
    rel = 0.5 * torch.randn(GRAPH.num_edge_types, dim, generator=gen)
    kpm = ~node_present(torch.tensor([10, 6]), 10)
    leaves = [t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in (q, k, v, rel)]
    return leaves, kpm.to(device)


def _plan_args(device="cpu"):
    plan = cuda_backend.plan_on(GRAPH, device, SPLIT)
    return (plan.indices, plan.edge_type, *plan.by_query.args(), plan.t_query, plan.t_edge, *plan.by_key.args())


def _attention(kpm, dropout_p=0.0):
    """The backend's glue; the work plan is built here, outside any trace (as ``prepare``
    builds it before a compiled model's first call)."""
    cuda_backend.plan_on(GRAPH, "cpu", SPLIT)

    def attention(q, k, v, rel):
        return cuda_backend.fused_graph_attention(q, k, v, GRAPH, rel, kpm, dropout_p,
                                                  seed=registry.dropout_seed(q.device, dropout_p), split_edges=SPLIT)
    return attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fake_implementations_on_the_meta_device(dtype):
    """Shapes and dtypes without the extension (none can be built here) or the emulation."""
    (q, k, v, rel), kpm = _inputs(dtype, device="meta")
    rng = torch.empty(2, dtype=torch.int64, device="meta")
    out, lse = cuda_backend.forward_op(q, k, v, rel, kpm, *_plan_args("meta"), 0.25, 0.1, rng)
    assert (out.device.type, out.shape, out.dtype) == ("meta", q.shape, dtype)
    assert (lse.shape, lse.dtype) == (q.shape[:3], torch.float32)
    for need_rel_grad, rel_rows in ((True, GRAPH.num_edge_types), (False, 0)):
        grads = cuda_backend.backward_op(out, q, k, v, out, lse, rel, kpm, *_plan_args("meta"), 0.25, 0.1, rng,
                                         need_rel_grad)
        assert [(g.shape, g.dtype) for g in grads] == [(q.shape, dtype)] * 3 + [((rel_rows, 32), dtype)]
    # and the whole glue, autograd included, traces on meta tensors
    (q, k, v, rel), kpm = _inputs(dtype, requires_grad=True, device="meta")
    out = _attention(kpm, 0.1)(q, k, v, rel)
    out.sum().backward()
    assert out.shape == q.shape and [t.grad.shape for t in (q, k, v, rel)] == [t.shape for t in (q, k, v, rel)]
    # nothing tried to build or load the extension: registering and tracing the ops need none
    assert cuda_backend.EXTENSION._module is None and cuda_backend.EXTENSION._error is None


@pytest.mark.parametrize("dropout_p,strided", [(0.0, False), (0.3, True)])
def test_opcheck_of_both_ops(emulation, dropout_p, strided):
    """Schema, fake implementations against the kernels (shapes, dtypes, strides: the
    outputs are contiguous whatever the inputs' layout), autograd registration and AOT
    dispatch (the checks ``torch.library.opcheck`` runs)."""
    (q, k, v, rel), kpm = _inputs(requires_grad=True, strided=strided)
    assert q.is_contiguous() != strided
    rng = registry.dropout_seed(q.device, dropout_p)
    args = (q, k, v, rel, kpm, *_plan_args(), 0.25, dropout_p, rng)
    torch.library.opcheck(torch.ops.fairseq_plugins.cuda_graph_attention.default, args)
    out, lse = cuda_backend.forward_op(*args)
    grad_out = torch.randn_like(out)
    for need_rel_grad in (True, False):
        torch.library.opcheck(torch.ops.fairseq_plugins.cuda_graph_attention_backward.default,
                              (grad_out, *(t.detach() for t in (q, k, v, out, lse, rel)), kpm, *_plan_args(),
                               0.25, dropout_p, rng, need_rel_grad))


def test_a_compiled_call_matches_eager_forward_and_gradients(emulation):
    (q, k, v, rel), kpm = _inputs()
    attention = _attention(kpm)
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    grad_out = torch.randn_like(q)
    eager = run(attention, [q, k, v, rel], grad_out)
    traced = run(compiled, [q, k, v, rel], grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv", "drel"), traced, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_compiled_dropout_draws_a_new_mask_per_call_and_the_seed_reproduces_it(emulation):
    """The (seed, offset) tensor is drawn inside the compiled graph, as it would be inside a
    captured CUDA graph: a new mask on every call, and ``torch.manual_seed`` gives eager's."""
    (q, k, v, rel), kpm = _inputs()
    attention = _attention(kpm, 0.3)
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    grad_out = torch.randn_like(q)
    torch.manual_seed(5)
    first, second = run(compiled, [q, k, v, rel], grad_out), run(compiled, [q, k, v, rel], grad_out)
    torch.manual_seed(5)
    eager = run(attention, [q, k, v, rel], grad_out)
    assert not torch.equal(first[0], second[0])
    for name, a, b in zip(("out", "dq", "dk", "dv", "drel"), first, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_masks_of_forward_and_backward_agree_and_follow_the_seed(emulation, dtype):
    (q, k, v, rel), kpm = _inputs(dtype)
    check_dropout(GRAPH, q, k, v, rel, kpm, 0.3, split_edges=SPLIT, seed=7)


class _NoHostReads(TorchDispatchMode):
    """Fails on a device-to-host read of a tensor's value (``.item()``, ``int()``, ``bool()``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a host read of a tensor value on the dropout path")
        return func(*args, **(kwargs or {}))


def test_the_dropout_path_never_reads_a_value_on_the_host(emulation):
    (q, k, v, rel), kpm = _inputs(requires_grad=True)
    attention = _attention(kpm, 0.3)
    with _NoHostReads():
        out = attention(q, k, v, rel)
        out.backward(torch.ones_like(out))
    assert rel.grad is not None
    with pytest.raises(AssertionError, match="host read"), _NoHostReads():
        q.sum().item()  # the check sees one


def test_every_kernel_launch_is_inside_a_device_guard(emulation):
    """The emulation refuses a launch outside ``GA_DEVICE_GUARD`` (a ``CUDAGuard`` on the GPU):
    forward, backward and the merges of split rows, with dropout and relative keys."""
    (q, k, v, rel), kpm = _inputs()
    plan = cuda_backend.plan_on(GRAPH, "cpu", SPLIT)
    assert plan.by_query.merges.size(0) and plan.by_key.merges.size(0)  # every kernel launches
    out, dq, dk, dv, drel = run(_attention(kpm, 0.2), [q, k, v, rel], torch.randn_like(q))
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv, drel))


def test_dropout_without_its_seed_tensor_is_refused(emulation):
    (q, k, v, rel), kpm = _inputs()
    with pytest.raises(RuntimeError, match=r"int64 \[2\] tensor on cpu"):
        cuda_backend.forward_op(q, k, v, rel, kpm, *_plan_args(), 0.25, 0.1, None)
    with pytest.raises(RuntimeError, match=r"int64 \[2\] tensor on cpu"):
        cuda_backend.forward_op(q, k, v, rel, kpm, *_plan_args(), 0.25, 0.1, torch.zeros(2, dtype=torch.int32))


@needs_traceable_op
def test_a_compiled_bpt_layer_on_the_kernels_matches_eager(emulation, monkeypatch):
    """A BPT encoder layer whose attention is the CUDA backend's glue and ops (under another
    name: ``cuda`` itself refuses CPU tensors), compiled without a graph break."""
    from fairseq.models.transformer import TransformerConfig

    from fairseq_plugins.modules.bpt.graph_transformer_layers import GraphEncoderLayer

    def kernels(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale, seed):
        return cuda_backend.fused_graph_attention(query, key, value, graph, rel_key, key_padding_mask, dropout_p,
                                                  scale, seed, split_edges=SPLIT)

    def prepare(query, graph):
        cuda_backend.plan_on(graph, query.device, SPLIT)
    monkeypatch.setattr(registry, "DEFAULT", registry.Dispatcher())  # the op's, for this test
    registry.DEFAULT.register(registry.Backend("cuda_kernels_on_cpu", kernels, prepare=prepare, seeded=True))
    graph = bpt_graph(12, 2)
    cfg = TransformerConfig()
    cfg.encoder.embed_dim, cfg.encoder.ffn_embed_dim, cfg.encoder.attention_heads = 64, 64, 2
    cfg.attention_dropout, cfg.dropout = 0.0, 0.0
    torch.manual_seed(0)
    layer = GraphEncoderLayer(cfg, graph.num_edge_types, backend="cuda_kernels_on_cpu")
    absent = ~node_present(torch.tensor([12, 7]), 12)
    x = torch.randn(graph.num_nodes, 2, 64)
    grad = torch.randn(graph.num_nodes, 2, 64)

    def step(x):
        return layer(x, absent, graph)

    def outputs(fn):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out.backward(grad)
        results = {"out": out.detach(), "x": leaf.grad}
        results.update((name, p.grad.clone()) for name, p in layer.named_parameters() if p.grad is not None)
        layer.zero_grad()
        return results
    eager = outputs(step)
    compiled = outputs(torch.compile(step, fullgraph=True, backend="aot_eager"))
    assert compiled.keys() == eager.keys() and "self_attn.rel_key" in eager
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-5, atol=1e-5, msg=name)
