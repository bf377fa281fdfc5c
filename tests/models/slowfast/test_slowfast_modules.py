"""TranSFormer building blocks: word GCN, boundary-wise relative PE, cross-granularity
fusion, and the encoder assembled from them (padding invariance, every ablation option)."""

import argparse

import pytest
import torch

from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY
from fairseq_plugins.models.transformer_slowfast import TransformerSlowFastModel
from fairseq_plugins.modules.slowfast.boundary_relative_attention import (
    AddToDiagonals,
    BoundaryRelativeSelfAttention,
    band_relation_types,
    boundary_band,
    boundary_relation_types,
)
from fairseq_plugins.modules.slowfast.cross_granularity_fusion import (
    FUSION_METHODS,
    build_fusion,
    characters_to_subwords,
)
from fairseq_plugins.modules.common.length_groups import length_groups
from fairseq_plugins.modules.slowfast.slowfast_encoder import parse_interaction_layers, random_word_ids
from fairseq_plugins.modules.slowfast.word_graph_convolution import (
    WordGraph,
    WordGraphConvolution,
    normalized_word_adjacency,
)

WORD_IDS = torch.tensor([[0, 0, 0, 1, 2, 2, -1, -1], [-1, 0, 1, 1, 1, 1, 2, 3]])


def test_gcn_normalisation_is_symmetric_degree_normalised_word_cliques():
    adj = normalized_word_adjacency(WORD_IDS)
    assert torch.allclose(adj, adj.transpose(1, 2))
    # a unit of an n-unit word: D^-1/2 (A+I) D^-1/2 has n entries of 1/sqrt(n*n) = 1/n
    assert torch.allclose(adj[0, 0, :3], torch.full((3,), 1 / 3)) and adj[0, 0, 3:].abs().sum() == 0
    assert adj[0, 3, 3] == 1 and adj[1, 2, 2:6].tolist() == [0.25] * 4
    assert adj[0, 6:].abs().sum() == 0 and adj[1, :, 0].abs().sum() == 0  # padding
    x = torch.randn(8, 2, 16, dtype=torch.float64)
    gcn = WordGraphConvolution(16).double()
    expected = torch.relu(torch.einsum("bij,jbc->ibc", adj.double(), gcn.proj(x)))
    for dense in (True, False):  # dense adjacency and per-word mean
        assert torch.allclose(gcn(x, WordGraph(WORD_IDS, dense=dense)), expected)


def test_word_graph_paths_agree_in_gradients_and_choose_by_length():
    x = torch.randn(2, 8, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 8, 4, dtype=torch.float64)
    grads = []
    for dense in (True, False):
        (grad,) = torch.autograd.grad((WordGraph(WORD_IDS, dense=dense).propagate(x) * weight).sum(), x)
        grads.append(grad)
    assert torch.allclose(*grads)
    assert WordGraph(WORD_IDS).adjacency is not None
    assert WordGraph(torch.zeros(1, 300, dtype=torch.long)).adjacency is None  # long: per-word mean


def test_boundary_relation_types_stay_inside_the_word_and_the_window():
    word_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, -1]])  # "goodn" "ew" + pad, window 3
    types = boundary_relation_types(word_ids, window=3)[0]
    none = 7
    assert types[0, :5].tolist() == [3, 4, 5, 6, none]  # distance 4 is outside the window
    assert types[4, :5].tolist() == [none, 0, 1, 2, 3]
    assert types[4, 5] == none and types[5, 4] == none  # other word
    assert types[5, 5:7].tolist() == [3, 4] and (types[7] == none).all() and (types[:, 7] == none).all()
    vanilla = boundary_relation_types(word_ids, window=3, restrict_to_word=False)[0]
    assert vanilla[4, 5] == 4 and vanilla[0, 4] == none
    with pytest.raises(ValueError):
        boundary_relation_types(word_ids, window=-1)


@pytest.mark.parametrize("window", [0, 1, 3])
@pytest.mark.parametrize("restrict", [True, False])
def test_band_holds_the_dense_relation_types(window, restrict):
    band = boundary_band(WORD_IDS, window, restrict_to_word=restrict)
    assert band.shape == (2, 8, 2 * window + 1)
    assert torch.equal(band_relation_types(band), boundary_relation_types(WORD_IDS, window, restrict_to_word=restrict))
    with pytest.raises(ValueError):
        boundary_band(WORD_IDS, window=-1)


def test_add_to_diagonals_gradients():
    scores = torch.randn(3, 6, 6, dtype=torch.float64, requires_grad=True)
    band = torch.randn(3, 6, 5, dtype=torch.float64, requires_grad=True)

    def dense(s, b):
        types = band_relation_types(torch.ones(3, 6, 5, dtype=torch.bool))  # 5 = no relation
        return s + torch.cat([b, b.new_zeros(3, 6, 1)], 2).gather(2, types)

    assert torch.allclose(AddToDiagonals.apply(scores.clone(), band), dense(scores, band))
    assert torch.autograd.gradcheck(lambda s, b: AddToDiagonals.apply(s.clone(), b), (scores, band))
    for length in range(1, 5):  # shorter than the band is wide
        short = torch.zeros(1, length, length, dtype=torch.float64)
        band = torch.arange(length * 7, dtype=torch.float64).view(1, length, 7)
        out = AddToDiagonals.apply(short, band)
        for i in range(length):
            for j in range(length):
                assert out[0, i, j] == (band[0, i, j - i + 3] if abs(j - i) <= 3 else 0)


def test_relative_attention_fast_path_equals_reference_and_ignores_padding():
    torch.manual_seed(0)
    attn = BoundaryRelativeSelfAttention(16, 4, window=2).double().eval()
    x = torch.randn(8, 2, 16, dtype=torch.float64, requires_grad=True)
    pad = WORD_IDS.lt(0)
    band = boundary_band(WORD_IDS, 2)
    out = attn(x, pad, band)
    reference = attn(x, pad, band, reference=True)
    assert torch.allclose(out, reference)
    weight = torch.randn_like(out)
    params = [x, *attn.parameters()]
    fast_grads = torch.autograd.grad((out * weight)[~pad.t()].sum(), params)
    reference_grads = torch.autograd.grad((reference * weight)[~pad.t()].sum(), params)
    for a, b in zip(fast_grads, reference_grads):
        assert torch.allclose(a, b)
    x2 = x.detach().clone()
    x2[6:, 0] = 100.0
    assert torch.allclose(attn(x2, pad, band)[:6, 0], out[:6, 0])
    plain = BoundaryRelativeSelfAttention(16, 4, window=None)
    assert plain.relative_keys is None
    with pytest.raises(ValueError, match="band"):
        plain(x.float(), pad, band)
    with pytest.raises(ValueError, match="divisible"):
        BoundaryRelativeSelfAttention(16, 3)


@pytest.mark.parametrize("method", FUSION_METHODS)
def test_fusion_shapes_both_ways(method):
    slow_len, fast_len, bsz, slow_dim, fast_dim = 5, 13, 2, 24, 8
    subword_ids = torch.randint(0, slow_len, (bsz, fast_len)).sort(1).values
    subword_ids[1, -3:] = -1
    fast_pad = subword_ids.lt(0)
    xs, xf = torch.randn(slow_len, bsz, slow_dim), torch.randn(fast_len, bsz, fast_dim)
    to_slow = build_fusion(method, slow_dim, fast_dim, 4, 0.0, to_slow=True)
    to_fast = build_fusion(method, fast_dim, slow_dim, 2, 0.0, to_slow=False)
    assert to_slow(xs, xf, fast_pad, subword_ids).shape == xs.shape
    assert to_fast(xf, xs, None, subword_ids).shape == xf.shape
    if method == "cga":  # keys/values are projected from the other branch's width (W in R^{Hs x Hf})
        assert to_fast.k_proj.weight.shape == (fast_dim, slow_dim)
        assert to_slow.k_proj.weight.shape == (slow_dim, fast_dim)
    with pytest.raises(ValueError, match="unknown fusion"):
        build_fusion("gated", slow_dim, fast_dim, 4, 0.0, True)


def test_cga_narrow_context_path_equals_the_direct_one():
    torch.manual_seed(0)
    cga = build_fusion("cga", 24, 8, 2, 0.0, to_slow=True).double()
    for p in cga.parameters():
        p.data.normal_()
    xs = torch.randn(5, 2, 24, dtype=torch.float64, requires_grad=True)
    xf = torch.randn(13, 2, 8, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, 13, dtype=torch.bool)
    pad[1, -4:] = True
    fast = cga(xs, xf, pad)
    direct = cga(xs, xf, pad, reference=True)
    assert torch.allclose(fast, direct)
    weight = torch.randn_like(fast)
    params = [xs, xf, *cga.parameters()]
    grads = torch.autograd.grad((fast * weight).sum(), params)
    direct_grads = torch.autograd.grad((direct * weight).sum(), params)
    for a, b in zip(grads, direct_grads):
        assert torch.allclose(a, b)
    xf = xf.detach().clone()
    xf[-4:, 1] = 1e3  # padding is ignored on both paths
    assert torch.allclose(cga(xs, xf, pad), fast)


def test_downsampling_is_the_mean_of_each_subwords_characters():
    fast = torch.arange(12.0).view(1, 6, 2)
    subword_ids = torch.tensor([[0, 0, 2, 2, 2, -1]])
    pooled = characters_to_subwords(fast, subword_ids, 3)
    assert pooled[0].tolist() == [[1.0, 2.0], [0.0, 0.0], [6.0, 7.0]]


def test_interaction_layer_specs():
    assert parse_interaction_layers("all", 6) == set(range(6))
    assert parse_interaction_layers("last", 6) == {5}
    assert parse_interaction_layers("bottom3", 6) == {0, 1, 2}
    assert parse_interaction_layers("top3", 6) == {3, 4, 5}
    assert parse_interaction_layers("every2", 6) == {0, 2, 4}
    assert parse_interaction_layers("1,3,5", 6) == {0, 2, 4}
    for bad in ("7", "top9", "sometimes", "0,1"):
        with pytest.raises(ValueError, match="interaction layers"):
            parse_interaction_layers(bad, 6)


def test_random_boundaries_keep_padding_and_roughly_the_word_rate():
    torch.manual_seed(0)
    word_ids = torch.arange(400).div(4, rounding_mode="floor").view(1, -1)
    word_ids = torch.cat([word_ids, torch.full((1, 20), -1)], 1)
    rand = random_word_ids(word_ids)
    assert (rand[0, 400:] == -1).all() and (rand[0, :400] >= 0).all()
    assert 70 < int(rand.max()) + 1 < 130  # about 100 words over 400 units


# --- the assembled model ------------------------------------------------------------

WORDS = "a swi@@ ss bicy@@ cle the dog runs fast@@ er".split()


def _dictionary():
    d = Dictionary()
    for w in WORDS:
        d.add_symbol(w)
    return d


def build_model(d, **options):
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    TransformerSlowFastModel.add_args(parser)
    args = parser.parse_args([])
    sizes = dict(
        encoder_layers=2, decoder_layers=1, encoder_embed_dim=24, decoder_embed_dim=24,
        encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32, encoder_attention_heads=2,
        decoder_attention_heads=2, fast_embed_dim=8, fast_attention_heads=2,
        max_source_positions=64, max_target_positions=64, dropout=0.0,
    )  # fmt: skip
    for k, v in {**sizes, **options}.items():
        setattr(args, k, v)
    ARCH_CONFIG_REGISTRY["transformer_slowfast"](args)
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    torch.manual_seed(0)
    return TransformerSlowFastModel.build_model(args, task).eval()


def _batch(d, sentences):
    rows = [[d.index(w) for w in s.split()] + [d.eos()] for s in sentences]
    width = max(map(len, rows))
    return torch.tensor([[d.pad()] * (width - len(r)) + r for r in rows])  # left-padded like fairseq


ABLATIONS = [
    {},
    dict(slowfast_fusion="linear-attention"),
    dict(slowfast_fusion="downsample-sum"),
    dict(slowfast_fusion="downsample-concat"),
    dict(slowfast_encoder_output="fast"),
    dict(slowfast_encoder_output="both"),
    dict(unidirectional_fusion=True),
    dict(fast_boundaries="none"),
    dict(no_boundary_pe=True),
    dict(boundary_pe_scope="window"),
    dict(slowfast_interaction_layers="last"),
    dict(fast_input="subword"),
    dict(fast_self_attention="linear", fast_linear_attention_length=4),
    dict(fast_self_attention="linear", fast_input="subword"),  # left-padded fast input
    dict(no_fast_branch=True),
    dict(no_slow_branch=True),
    dict(no_slow_branch=True, fast_boundaries="none", no_boundary_pe=True),  # a character-level transformer
    dict(slowfast_ode_block="rk2-gated"),
    dict(slowfast_ode_block="rk2", slowfast_encoder_output="both", slowfast_interaction_layers="last"),
    dict(slowfast_ode_block="rk2-gated", no_fast_branch=True),
]


@pytest.mark.parametrize("options", ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_a_sentence_encodes_the_same_alone_and_in_a_padded_batch(options):
    d = _dictionary()
    model = build_model(d, **options)
    sentences = ["the dog", "a swi@@ ss bicy@@ cle runs fast@@ er", "dog"]
    batch = model.encoder(_batch(d, sentences))
    out, mask = batch["encoder_out"][0], batch["encoder_padding_mask"][0]
    for i, s in enumerate(sentences):
        alone = model.encoder(_batch(d, [s]))["encoder_out"][0][:, 0]
        real = out[:, i][~mask[i]]
        assert real.shape == alone.shape
        assert torch.allclose(real, alone, atol=1e-5), options


def test_length_groups_split_only_when_it_pays():
    lengths = torch.tensor([3, 30, 4, 28, 5, 29, 6, 31, 2, 27])
    pad = torch.arange(31).view(1, -1) >= lengths.view(-1, 1)
    groups = length_groups(pad)
    assert [index.tolist() for index, _ in groups] == [[8, 0, 2], [4, 6, 9], [3, 5], [1, 7]]
    assert [size for _, size in groups] == [4, 27, 29, 31]
    assert length_groups(pad, max_groups=1) == [(None, 31)]
    assert length_groups(pad[:6]) == [(None, 31)]  # too few sentences
    assert length_groups(pad.flip(1)) == [(None, 31)]  # left-padded
    assert length_groups(torch.zeros(10, 31, dtype=torch.bool)) == [(None, 31)]  # nothing to save


@pytest.mark.parametrize("options", ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_the_fast_branch_in_length_groups_equals_one_batch(options):
    """Ten sentences of very different character lengths: the fast branch runs in four
    groups; outputs and gradients match the ungrouped run."""
    d = _dictionary()
    sentences = ["dog", "a swi@@ ss bicy@@ cle runs fast@@ er the dog runs fast@@ er", "the", "a dog runs",
                 "bicy@@ cle", "swi@@ ss dog runs a bicy@@ cle fast@@ er the dog", "runs", "the swi@@ ss dog",
                 "a", "fast@@ er bicy@@ cle the swi@@ ss dog runs fast@@ er a dog"]  # fmt: skip
    src = _batch(d, sentences)
    if options.get("fast_input", "char") == "char":
        assert len(length_groups(build_model(d).encoder.characters(src).padding_mask)) == 4
    results = []
    for groups in (4, 1):
        model = build_model(d, **options)
        if not options.get("no_fast_branch"):
            model.encoder.max_fast_groups = groups
        out = model.encoder(src)
        real = out["encoder_out"][0].transpose(0, 1)[~out["encoder_padding_mask"][0]]
        weight = torch.randn(real.shape, generator=torch.Generator().manual_seed(0))
        grads = torch.autograd.grad((real * weight).sum(), list(model.encoder.parameters()), allow_unused=True)
        results.append((real, grads))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-5))


def test_random_boundaries_and_training_mode_run_forward_and_backward():
    d = _dictionary()
    model = build_model(d, fast_boundaries="random", dropout=0.1).train()
    src = _batch(d, ["a swi@@ ss", "the dog runs"])
    out, _ = model(src, src.ne(d.pad()).sum(1), torch.full((2, 3), d.eos()))
    out.sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("spec, fast_layers", [("all", 3), ("bottom1", 1), ("every2", 3), ("2", 2)])
def test_no_parameter_goes_unused_for_any_interaction_layout(spec, fast_layers):
    d = _dictionary()
    model = build_model(d, encoder_layers=3, slowfast_interaction_layers=spec).train()
    assert len(model.encoder.fast_layers) == fast_layers
    assert not model.encoder.fast_layers[-1].has_feed_forward  # only its attention output is read
    src = _batch(d, ["a swi@@ ss", "the dog runs"])
    out, _ = model(src, src.ne(d.pad()).sum(1), torch.full((2, 3), d.eos()))
    out.sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_checkpoint_state_round_trips():
    d = _dictionary()
    model, fresh = build_model(d), build_model(d, dropout=0.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    fresh.load_state_dict(model.state_dict())
    src = _batch(d, ["a swi@@ ss bicy@@ cle"])
    assert torch.equal(fresh.encoder(src)["encoder_out"][0], model.encoder(src)["encoder_out"][0])
    assert "encoder.characters.character_codepoints" in model.state_dict()


def test_the_fast_branch_changes_the_slow_output_only_through_fusion():
    d = _dictionary()
    src = _batch(d, ["a swi@@ ss bicy@@ cle"])
    fused = build_model(d)
    slow_only = build_model(d, no_fast_branch=True)
    # same seed, same slow parameters: copy them over and compare
    slow_only.load_state_dict({k: v for k, v in fused.state_dict().items() if k in slow_only.state_dict()})
    a = fused.encoder(src)["encoder_out"][0]
    b = slow_only.encoder(src)["encoder_out"][0]
    assert not torch.allclose(a, b)
    for layer in fused.encoder.layers:
        layer.fusion = None
    assert torch.allclose(fused.encoder(src)["encoder_out"][0], b, atol=1e-6)


def test_parameter_counts_follow_the_fast_width():
    d = _dictionary()
    base = sum(p.numel() for p in build_model(d, no_fast_branch=True).parameters())
    narrow = sum(p.numel() for p in build_model(d, fast_embed_dim=8).parameters())
    wide = sum(p.numel() for p in build_model(d, fast_embed_dim=16).parameters())
    assert base < narrow < wide


def test_bad_options_are_refused():
    d = _dictionary()
    with pytest.raises(ValueError, match="divisible"):
        build_model(d, fast_embed_dim=10, fast_attention_heads=4)
    with pytest.raises(ValueError, match="no-fast-branch"):
        build_model(d, no_fast_branch=True, slowfast_encoder_output="fast")
    with pytest.raises(ValueError, match="interaction layers"):
        build_model(d, slowfast_interaction_layers="top5")


def test_vanilla_relative_pe_relates_characters_across_words():
    """Table 5 #5 compares with Shaw's window (Figure 4a): same weights, only the band differs,
    so a sentence of several words encodes differently, and a one-character word alone does not."""
    d = _dictionary()
    torch.manual_seed(0)
    word = build_model(d).eval()
    torch.manual_seed(0)
    window = build_model(d, boundary_pe_scope="window").eval()
    window.load_state_dict(word.state_dict())
    several = _batch(d, ["a swi@@ ss bicy@@ cle runs"])
    assert not torch.allclose(word.encoder(several)["encoder_out"][0], window.encoder(several)["encoder_out"][0])
    with pytest.raises(ValueError, match="--boundary-pe-scope 'sentence': choose from word, window"):
        build_model(d, boundary_pe_scope="sentence")


def test_activation_checkpointing_is_refused_not_ignored():
    """The encoder runs its layers in parts, past any wrapper of their forward."""
    with pytest.raises(ValueError, match="not supported by the Slow-Fast encoder"):
        build_model(_dictionary(), checkpoint_activations=True)
