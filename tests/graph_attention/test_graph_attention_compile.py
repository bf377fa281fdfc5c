"""``torch.compile(fullgraph=True)`` through the graph attention op, on CPU: the "cpu"
backend's kernels are ``torch.library`` ops with fake implementations, the torch backend's
dense and CSR paths are plain torch code, and the backend choice (imports, builds,
self-checks) is evaluated once while tracing. A BPT encoder layer compiles without a graph
break and matches eager, forward and gradients. ``aot_eager`` runs the traced forward and
backward graphs without code generation (the part that differs from inductor is codegen)."""

import pytest
import torch
from fairseq.models.transformer import TransformerConfig

from fairseq_plugins.graph_attention import cpu_backend, graph_attention
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present
from fairseq_plugins.modules.bpt.graph_transformer_layers import GraphEncoderLayer
from tests.compile_support import needs_traceable_op


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layer(backend, num_edge_types, attention_dropout=0.0):
    cfg = TransformerConfig()
    cfg.encoder.embed_dim, cfg.encoder.ffn_embed_dim, cfg.encoder.attention_heads = 32, 32, 2
    cfg.attention_dropout, cfg.dropout = attention_dropout, 0.0
    torch.manual_seed(0)
    return GraphEncoderLayer(cfg, num_edge_types, backend=backend)


def _needs_cpu_kernel(backend):
    if backend == "cpu":
        try:
            cpu_backend.load_extension()
        except Exception as error:
            pytest.skip(f"the cpu extension does not build here: {error}")


def _run(fn, layer, x, absent, grad, seed=1):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = fn(x, absent)
    out.backward(grad)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    return out.detach(), x.grad, grads


def assert_compiled_layer_matches_eager(layer, graph, tokens: int, width: int, fullgraph: bool = True) -> None:
    """``torch.compile`` (``fullgraph`` by default) of a graph layer over a padded batch of two equals
    eager mode: its output, the input's gradient and every parameter's (rel_key's included)."""
    absent = ~node_present(torch.tensor([tokens, tokens // 2]), tokens)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(graph.num_nodes, 2, width, generator=gen)
    grad = torch.randn(graph.num_nodes, 2, width, generator=gen)

    def step(x, absent):
        return layer(x, absent, graph)
    compiled = torch.compile(step, fullgraph=fullgraph, backend="aot_eager")
    eager_out, eager_dx, eager_grads = _run(step, layer, x, absent, grad)
    out, dx, grads = _run(compiled, layer, x, absent, grad)
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, eager_dx, rtol=1e-5, atol=1e-5)
    assert grads.keys() == eager_grads.keys() and "self_attn.rel_key" in grads
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-5, atol=1e-5, msg=name)


# tokens -> path of the torch backend: 10 tokens are dense, 70 a tree graph (the CSR path
# when compiled; the tree path in eager mode)
@needs_traceable_op
@pytest.mark.parametrize("tokens", [10, 70])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_compiled_bpt_layer_matches_eager_forward_and_gradients(backend, tokens):
    _needs_cpu_kernel(backend)
    graph = bpt_graph(tokens, 2)
    layer = _layer(backend, graph.num_edge_types)
    assert_compiled_layer_matches_eager(layer, graph, tokens, 32)


@needs_traceable_op
def test_the_cpu_kernels_dropout_compiles_and_draws_from_torchs_generator():
    """The seed is a tensor drawn in the graph: torch.manual_seed reproduces a compiled
    call's mask, a new call draws a new one, and eager gives the same as compiled."""
    _needs_cpu_kernel("cpu")
    graph = bpt_graph(20, 2)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, graph.num_nodes, 16, generator=gen) for _ in range(3))

    def attend(q, k, v):
        return graph_attention(q, k, v, graph, dropout_p=0.3, backend="cpu")
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    first, second = compiled(q, k, v), compiled(q, k, v)
    torch.manual_seed(5)
    again = compiled(q, k, v)
    torch.manual_seed(5)
    eager = attend(q, k, v)
    assert not torch.equal(first, second)
    assert torch.equal(first, again) and torch.equal(first, eager)


def test_the_kernel_ops_have_fake_implementations():
    """What torch.compile traces with: shapes and dtypes without running the kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    graph = bpt_graph(8, 2)
    indptr, indices, types = graph.on("cpu", torch.int32)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(graph.num_nodes, 4, 16)  # node-major [N, BH, D], as fairseq's layers hold it
        rel = torch.empty(graph.num_edge_types, 16)
        seed = torch.zeros((), dtype=torch.int64)
        out, lse = cpu_backend.forward_op(q, q, q, rel, None, indptr, indices, types, 2, 0.25, 0.0, seed)
        grads = cpu_backend.backward_op(out, q, q, q, out, lse, rel, None, indptr, indices, types, 2, 0.25,
                                        0.0, seed)
    assert out.shape == q.shape and lse.shape == (4, graph.num_nodes)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape)] * 3 + [tuple(rel.shape)]
    torch.library.opcheck(torch.ops.fairseq_plugins.cpu_graph_attention.default,
                          (torch.randn(graph.num_nodes, 4, 16, requires_grad=True),
                           torch.randn(graph.num_nodes, 4, 16, requires_grad=True),
                           torch.randn(graph.num_nodes, 4, 16, requires_grad=True),
                           torch.randn(graph.num_edge_types, 16, requires_grad=True), None,
                           indptr, indices, types, 2, 0.25, 0.0, torch.zeros((), dtype=torch.int64)))


def test_before_the_traceable_torch_the_op_runs_outside_the_compiled_graph(monkeypatch):
    """Where torch cannot trace the op (2.11: a Dynamo error in every compiled model), it breaks
    the graph instead: a compiled layer still equals eager, and fullgraph=True names why not."""
    from fairseq_plugins.graph_attention import registry

    monkeypatch.setattr(registry, "TRACEABLE_FROM", (99, 0))
    torch._dynamo.reset()
    graph = bpt_graph(10, 2)
    layer = _layer("torch", graph.num_edge_types)
    assert_compiled_layer_matches_eager(layer, graph, 10, 32, fullgraph=False)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="traces graph_attention from torch 99.0 on"):
        assert_compiled_layer_matches_eager(layer, graph, 10, 32)
    torch._dynamo.reset()
