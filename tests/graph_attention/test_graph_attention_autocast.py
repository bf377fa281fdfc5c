"""``graph_attention`` under autocast (fairseq's ``--amp``) with a float32 ``rel_key``, on
every backend that runs on a CPU: CPU autocast (bfloat16 and float16), the Triton kernels
through the interpreter. Forward and the four gradients against float64 on the same values;
the output comes in autocast's dtype and every gradient in its leaf's dtype."""

import pytest
import torch

from fairseq_plugins.graph_attention import graph_attention, registry
from fairseq_plugins.graphs.attention_graph import AttentionGraph
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
TOLERANCE = {torch.bfloat16: 4e-2, torch.float16: 6e-3}  # of the largest reference value

TORCH_FN = registry.DEFAULT.get("torch").fn


def tree_free(graph: AttentionGraph) -> AttentionGraph:
    return AttentionGraph(graph.num_nodes, graph.indptr, graph.indices, graph.edge_type,
                          graph.num_edge_types)


# name -> (graph, sentence lengths); the torch backend's three paths: dense (<= 96 nodes),
# tree, and CSR (a large graph without a tree layout)
GRAPHS = {
    "dense": (lambda: bpt_graph(20, 2), [20, 9]),
    "tree": (lambda: bpt_graph(70, 2), [70, 33]),
    "csr": (lambda: tree_free(bpt_graph(70, 2)), None),
}


def leaves(graph, lengths, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bsz = 2
    q, k, v = (torch.randn(bsz, 2, graph.num_nodes, dim, generator=gen) for _ in range(3))
    rel = 0.5 * torch.randn(graph.num_edge_types, dim, generator=gen)
    mask = None
    if lengths is not None:
        mask = ~node_present(torch.tensor(lengths), graph.tree.num_tokens)
    grad = torch.randn(q.shape, generator=gen)
    return [q, k, v, rel], mask, grad


def check_under_autocast(backend, graph, lengths, dtype, dim=32, backward=True):
    tensors, mask, grad = leaves(graph, lengths, dim)
    low = [t.clone().requires_grad_(backward) for t in tensors]  # float32, as a model's parameters
    with torch.autocast("cpu", dtype=dtype):
        out = graph_attention(*low[:3], graph, low[3], mask, backend=backend)
        assert out.dtype == dtype
        if backward:  # backward called under autocast too (CPU: in the caller's thread)
            out.backward(grad.to(dtype))
    # the reference: float64 on the values the op computed with (q, k, v rounded to dtype)
    ref = [t.to(dtype).double().requires_grad_() for t in tensors[:3]]
    ref.append(tensors[3].double().requires_grad_())
    expected = graph_attention(*ref[:3], graph, ref[3], mask, backend="torch")
    expected.backward(grad.to(dtype).double())
    scale = max(expected.abs().max().item(), 1.0)
    error = (out.double() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, f"{backend} output: {error:.3g}"
    if not backward:
        return
    for name, actual, wanted in zip(("q", "k", "v", "rel_key"), low, ref):
        assert actual.grad.dtype == torch.float32, f"grad {name} is {actual.grad.dtype}"
        scale = max(wanted.grad.abs().max().item(), 1.0)
        error = (actual.grad.double() - wanted.grad).abs().max().item()
        assert error <= TOLERANCE[dtype] * scale, f"{backend} grad {name}: {error:.3g}"


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES)
@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_torch_paths_and_auto_under_cpu_autocast(backend, graph, dtype):
    build, lengths = GRAPHS[graph]
    check_under_autocast(backend, build(), lengths, dtype)


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES)
def test_cpu_kernel_under_cpu_autocast(dtype):
    from fairseq_plugins.graph_attention import cpu_backend
    try:
        cpu_backend.load_extension()
    except Exception as error:
        pytest.skip(f"the cpu extension does not build here: {error}")
    check_under_autocast("cpu", bpt_graph(70, 2), [70, 33], dtype)
    q = torch.zeros(1, 1, 4, 16)
    with torch.autocast("cpu", dtype=dtype):  # auto keeps the kernel under autocast
        assert registry.DEFAULT.auto(q.to(dtype), bpt_graph(2, 2)) == "cpu"


def test_flex_forward_under_cpu_autocast():
    pytest.importorskip("torch.nn.attention.flex_attention")
    check_under_autocast("flex", bpt_graph(20, 2), [20, 9], torch.bfloat16, backward=False)


def test_triton_kernels_under_cpu_autocast():
    pytest.importorskip("triton")
    from tests.triton_interpreter import skip_reason

    if skip_reason():
        pytest.skip(skip_reason())
    check_under_autocast("triton", bpt_graph(20, 2), [20, 9], torch.bfloat16)


def test_the_backends_run_with_autocast_off_and_get_autocast_dtype_inputs():
    seen = []

    def spy(query, key, value, graph, rel_key, *rest):
        seen.append((query.dtype, key.dtype, value.dtype, rel_key.dtype,
                     torch.is_autocast_enabled("cpu")))
        return TORCH_FN(query, key, value, graph, rel_key, *rest)
    dispatcher = registry.Dispatcher()
    dispatcher.register(registry.Backend("spy", spy))
    graph = bpt_graph(6, 2)
    q = torch.randn(1, 1, graph.num_nodes, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dispatcher.graph_attention(q, q, q, graph, torch.zeros(graph.num_edge_types, 8), backend="spy")
        dispatcher.graph_attention(q.double(), q.double(), q.double(), graph, torch.zeros(graph.num_edge_types, 8),
                                   backend="spy")
    assert seen == [(torch.bfloat16,) * 3 + (torch.float32, False),
                    (torch.float64,) * 3 + (torch.float32, False)]


def _encoder_layer(backend):
    from fairseq.models.transformer import TransformerConfig

    from fairseq_plugins.modules.bpt.graph_transformer_layers import GraphEncoderLayer
    cfg = TransformerConfig()
    cfg.encoder.embed_dim, cfg.encoder.ffn_embed_dim, cfg.encoder.attention_heads = 64, 64, 2
    torch.manual_seed(0)
    return GraphEncoderLayer(cfg, bpt_graph(2, 2).num_edge_types, backend=backend)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_bpt_layer_trains_under_autocast_and_in_bfloat16(backend):
    """fairseq's --amp (autocast over float32 parameters) and --bf16 (parameters cast)."""
    graph = bpt_graph(40, 2)
    absent = ~node_present(torch.tensor([40, 17]), 40)
    x = torch.randn(graph.num_nodes, 2, 64, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    layer = _encoder_layer(backend)
    torch.manual_seed(3)  # the same dropout masks in both runs
    layer(x, absent, graph).backward(grad)
    # the attention's parameters (the rest is fairseq's; and fairseq's BetterTransformer
    # copies of the weights are parameters that no forward uses)
    reference = {name: p.grad.clone() for name, p in layer.named_parameters() if name.startswith("self_attn.")}
    assert "self_attn.rel_key" in reference
    layer.zero_grad()
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, absent, graph)
    out.float().backward(grad)
    for name, p in layer.named_parameters():
        if name not in reference:
            continue
        assert p.grad.dtype == torch.float32, name
        error = (p.grad - reference[name]).abs().max().item()
        assert error <= 5e-2 * max(reference[name].abs().max().item(), 1.0), (name, error)
    layer.zero_grad()
    layer.to(torch.bfloat16)
    layer(x.bfloat16(), absent, graph).backward(grad.bfloat16())
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
               for name, p in layer.named_parameters() if name in reference)


def test_auto_checks_a_backend_with_float32_relative_keys_under_autocast(monkeypatch):
    """Under autocast the op gets bfloat16 queries and a float32 rel_key: the self-check runs
    that mix, so a backend that mishandles it is not picked."""
    def loses_a_float32_rel_key_gradient(query, key, value, graph, rel_key, *rest):
        if rel_key.dtype == query.dtype:
            return TORCH_FN(query, key, value, graph, rel_key, *rest)
        out = TORCH_FN(query, key, value, graph, rel_key.detach().to(query.dtype), *rest)
        return out + 0 * rel_key.sum()  # d rel_key: zeros, in its dtype

    monkeypatch.delenv(registry.BACKEND_ENV, raising=False)
    dispatcher = registry.Dispatcher(auto_candidates=("triton", "torch"), timed_devices=("cpu",))
    dispatcher.register(registry.Backend("triton", loses_a_float32_rel_key_gradient))
    graph = bpt_graph(6, 2)
    q = torch.randn(1, 1, graph.num_nodes, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(RuntimeWarning, match="d rel_key differs"):
        dispatcher.graph_attention(q, q, q, graph, torch.randn(graph.num_edge_types, 16))
    assert (("triton", "cpu", torch.bfloat16, 16, torch.float32) in dispatcher.self_checks)


def test_cuda_kernels_glue_under_cpu_autocast(monkeypatch):
    """The CUDA backend's glue around its kernels, run by the host emulation on the CPU."""
    from fairseq_plugins.graph_attention import cuda_backend
    from tests.cuda_ext_emulation import load_emulation
    try:
        load_emulation()  # the CPU kernel of the backend's ops
    except Exception as error:
        pytest.skip(f"the host emulation does not build here: {error}")

    def emulated(query, key, value, graph, rel_key, mask, dropout_p, scale, seed):
        return cuda_backend.fused_graph_attention(query, key, value, graph, rel_key, mask, dropout_p, scale, seed,
                                                  split_edges=4)
    monkeypatch.setattr(registry, "DEFAULT", registry.Dispatcher())  # the op's, for this test
    registry.register_backend("cuda_emulation", emulated, seeded=True)
    check_under_autocast("cuda_emulation", bpt_graph(20, 2), [20, 9], torch.bfloat16)
