"""The fast-branch-only TranSFormer (``--no-slow-branch``, the paper's Fast Only baseline, and with
no boundaries and no boundary PE its character-level Transformer): the fast branch of the
two-branch model without fusion, nothing of the slow branch left, through the real fairseq CLIs."""

import pytest
import torch

from tests.cli import hypotheses, train_and_translate
from tests.models.slowfast.test_slowfast_modules import _batch, _dictionary, build_model

SENTENCES = ["a swi@@ ss bicy@@ cle runs", "the dog", "fast@@ er dog"]
CHARACTER_TRANSFORMER = dict(fast_boundaries="none", no_boundary_pe=True)


@pytest.mark.parametrize("options", [{}, CHARACTER_TRANSFORMER], ids=["fast-only", "character-transformer"])
def test_fast_only_is_the_two_branch_models_fast_branch_without_fusion(options):
    """Same weights: the fast-only encoder's output is the fast output (Table 4c's ``fast``) of the
    two-branch model with every fusion sublayer removed, forward and gradients, in float64."""
    d = _dictionary()
    both = build_model(d, slowfast_encoder_output="fast", **options).double()
    alone = build_model(d, no_slow_branch=True, **options).double()
    shared = {k: v for k, v in both.state_dict().items() if k in alone.state_dict()}
    assert set(alone.state_dict()) - set(shared) == set()  # the fast-only model is a part of the two-branch one
    alone.load_state_dict(shared)
    for layer in [*both.encoder.layers, *both.encoder.fast_layers]:
        layer.fusion = None
    src = _batch(d, SENTENCES)
    outs = []
    for model in (both, alone):
        out = model.encoder(src)
        params = [p for n, p in model.named_parameters() if n.startswith(("encoder.fast_", "decoder.layers.0"))]
        x = out["encoder_out"][0]
        outs.append((x, out["encoder_padding_mask"][0], torch.autograd.grad(x.square().sum(), params[:8],
                                                                           allow_unused=True)))
    (x1, m1, g1), (x2, m2, g2) = outs
    assert torch.equal(m1, m2) and x1.shape[-1] == 24  # the decoder's width
    torch.testing.assert_close(x1, x2)
    for a, b in zip(g1, g2):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b))


def test_nothing_of_the_slow_branch_is_left_and_every_parameter_trains():
    d = _dictionary()
    model = build_model(d, no_slow_branch=True).train()
    enc = model.encoder
    assert len(enc.layers) == 0 and len(enc.fast_layers) == 2 and enc.output == "fast"
    assert enc.embed_tokens is None and enc.layer_norm is None
    assert all(layer.fusion is None and layer.has_feed_forward for layer in enc.fast_layers)
    src = _batch(d, SENTENCES)
    out, _ = model(src, src.ne(d.pad()).sum(1), torch.full((3, 4), d.eos()))
    out.sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    assert not any(k.startswith("encoder.embed_tokens") for k in model.state_dict())
    plain = build_model(d, no_slow_branch=True, **CHARACTER_TRANSFORMER)
    for layer in plain.encoder.fast_layers:  # no F-GCN, no relative positions: plain attention over characters
        assert layer.word_graph is None and layer.self_attn.relative_keys is None


def test_contradictory_options_are_refused():
    d = _dictionary()
    with pytest.raises(ValueError, match="--no-slow-branch leaves only the fast branch"):
        build_model(d, no_slow_branch=True, slowfast_encoder_output="both")
    with pytest.raises(ValueError, match="leaves only the"):
        build_model(d, no_slow_branch=True, no_fast_branch=True)


@pytest.mark.slow
def test_fast_only_through_fairseq_train_generate_interactive(tiny_data_bin, tmp_path):
    """Separate dictionaries: the encoder's unused subword embedding is dropped, and the checkpoint
    loads without it."""
    extra = ["--no-slow-branch", "--fast-embed-dim", "16", "--fast-attention-heads", "2", "--dropout", "0.1"]
    result = train_and_translate(tiny_data_bin, tmp_path / "ckpt", "transformer_slowfast", extra, max_update=20)
    assert "no_slow_branch=True" in result["train_log"] and "slowfast_encoder_output='fast'" in result["train_log"]
    state = torch.load(result["checkpoint"], map_location="cpu", weights_only=False)["model"]
    assert not any(k.startswith(("encoder.layers.", "encoder.embed_tokens")) for k in state)
    assert len(hypotheses(result["generate_out"])) == 40
    assert len(hypotheses(result["interactive_out"])) == 2
