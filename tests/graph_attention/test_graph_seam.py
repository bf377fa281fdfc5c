"""The seam between the models and the op: graphs are arguments, what backends derive from
a graph lives in one bounded cache, and a decoding step is a (rectangular) graph of the one
public op."""

import pytest
import torch
from fairseq.models.transformer import TransformerConfig

from fairseq_plugins.graph_attention import AttentionGraph, graph_attention
from fairseq_plugins.graphs.attention_graph import DerivedCache, DerivedKey
from fairseq_plugins.graphs.binary_partition import (
    TreeGraphSpec, causal_step_graph, creation_slot, node_levels, nodes_created,
)
from fairseq_plugins.modules.bpt.graph_self_attention import GraphSelfAttention
from fairseq_plugins.modules.bpt.graph_transformer_layers import GraphDecoderLayer


def test_the_derived_cache_is_bounded_oldest_first():
    cache, builds = DerivedCache(capacity=2), []

    def build(value):
        return lambda: builds.append(value) or value
    for name in ("a", "b", "a", "c", "b", "a"):
        cache.get(DerivedKey(name, "cpu"), build(name))
    # a, b built; a hit; c evicts a (oldest); b hit; a rebuilt, evicting b
    assert builds == ["a", "b", "c", "a"]
    assert cache.keys() == (DerivedKey("c", "cpu"), DerivedKey("a", "cpu"))


def test_backends_keep_what_they_derive_only_in_the_graph_cache():
    spec = TreeGraphSpec("bpt", 2, 2, False)
    graph = spec.build(130)  # long enough for the tree path
    q = torch.randn(1, 2, graph.num_nodes, 16)
    fields = set(vars(graph))
    graph_attention(q, q, q, graph, backend="torch")
    graph_attention(q, q, q, graph, backend="cpu")
    assert set(vars(graph)) == fields  # nothing stored on the graph itself
    kinds = {key.kind for key in graph._derived.keys()}  # noqa: SIM118 (a method, not a dict)
    assert {"tree_plan", "csr", "rows"} <= kinds


def full_rows_of_step(spec, t):
    """The step's rows taken from the full causal graph over t + 1 tokens, in cache slots."""
    full = spec.build(t + 1)
    level, index = node_levels(t + 1)
    slot = creation_slot(level, index)
    new = torch.nonzero((slot >= nodes_created(t)) & (slot < nodes_created(t + 1))).flatten()
    new = new[torch.argsort(slot[new])]
    rows = []
    for node in new.tolist():
        lo, hi = int(full.indptr[node]), int(full.indptr[node + 1])
        keys = slot[full.indices[lo:hi]]
        order = torch.argsort(keys)
        rows.append((keys[order].tolist(), full.edge_type[lo:hi][order].tolist()))
    return rows


@pytest.mark.parametrize("kind,k", [("bpt", 1), ("bpt", 2), ("segtree", 1)])
def test_a_decoding_step_graph_is_the_full_graphs_new_rows_over_the_cache(kind, k):
    spec = TreeGraphSpec(kind, k, 2, True)
    for t in range(17):
        step = causal_step_graph(spec, t)
        assert step.num_keys == nodes_created(t + 1) and step.square == (t == 0)
        rows = [(step.indices[lo:hi].tolist(), step.edge_type[lo:hi].tolist())
                for lo, hi in zip(step.indptr[:-1].tolist(), step.indptr[1:].tolist())]
        assert rows == full_rows_of_step(spec, t)


def test_a_rectangular_graph_through_the_public_op_matches_the_full_rows():
    """Step t's outputs equal the rows of a full causal pass, on every backend auto may pick."""
    spec = TreeGraphSpec("bpt", 2, 2, True)
    t = 11
    full = spec.build(t + 1)
    level, index = node_levels(t + 1)
    slot = creation_slot(level, index)
    by_slot = torch.argsort(slot)  # graph node of every cache slot (then the incomplete spans)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, full.num_nodes, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    rel = torch.randn(full.num_edge_types, 8, generator=gen, dtype=torch.float64)
    expected = graph_attention(q, k, v, full, rel, backend="torch")
    step = causal_step_graph(spec, t)
    created, new = by_slot[:nodes_created(t + 1)], by_slot[nodes_created(t):nodes_created(t + 1)]
    for backend in ("auto", "torch"):
        out = graph_attention(q[:, :, new], k[:, :, created], v[:, :, created], step, rel, backend=backend)
        torch.testing.assert_close(out, expected[:, :, new])
    with pytest.raises(RuntimeError, match="'cpu' cannot run these inputs: square graphs only"):
        graph_attention(q[:, :, new].float(), k[:, :, created].float(), v[:, :, created].float(), step,
                        rel.float(), backend="cpu")


def test_graph_checks_cover_rectangular_graphs():
    with pytest.raises(ValueError, match="key index out of range"):
        AttentionGraph(1, torch.tensor([0, 1]), torch.tensor([3]), torch.zeros(1, dtype=torch.long), 1,
                       num_keys=3)
    with pytest.raises(ValueError, match="indptr"):
        AttentionGraph(2, torch.tensor([1, 1, 1]), torch.tensor([0]), torch.zeros(1, dtype=torch.long), 1)
    graph = AttentionGraph(1, torch.tensor([0, 2]), torch.tensor([0, 2]), torch.zeros(2, dtype=torch.long), 1,
                           num_keys=3)
    q = torch.randn(1, 1, 1, 4)
    with pytest.raises(ValueError, match="1 query and 1 key nodes, the graph 1 query nodes over 3 keys"):
        graph_attention(q, q, q, graph)


def _decoder_layer():
    cfg = TransformerConfig()
    cfg.decoder.embed_dim, cfg.decoder.ffn_embed_dim, cfg.decoder.attention_heads = 16, 32, 2
    cfg.encoder.embed_dim = 16
    return GraphDecoderLayer(cfg, num_edge_types=TreeGraphSpec("bpt", 2, 2, True).types.num_types,
                             cross_attention_from="tokens")


def test_layers_hold_no_graph_and_register_no_hooks():
    torch.manual_seed(0)
    layer = _decoder_layer().eval()
    spec = TreeGraphSpec("bpt", 2, 2, True)
    graph = spec.build(6)
    x = torch.randn(graph.num_nodes, 2, 16)
    encoder_out = torch.randn(5, 2, 16)
    calls = []
    for module in layer.modules():  # a hook added during forward would be seen by this one
        module.register_forward_pre_hook(lambda m, args: calls.append(len(m._forward_hooks)))
    attention_state = dict(vars(layer.self_attn))
    out, _, _ = layer(x, encoder_out, None, graph=graph, num_tokens=6)
    assert set(calls) == {0} and dict(vars(layer.self_attn)).keys() == attention_state.keys()
    # span nodes pass the cross-attention sublayer unchanged: same as without an encoder
    # for them after it, i.e. their output does not depend on the encoder output
    other, _, _ = layer(x, encoder_out * 2, None, graph=graph, num_tokens=6)
    torch.testing.assert_close(out[6:], other[6:])
    assert not torch.allclose(out[:6], other[:6])


def test_self_attention_needs_a_graph_argument():
    attn = GraphSelfAttention(16, 2, 3)
    with pytest.raises(TypeError, match="needs an AttentionGraph"):
        attn(torch.randn(4, 1, 16), None)
