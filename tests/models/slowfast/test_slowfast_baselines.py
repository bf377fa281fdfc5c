"""The slow-only TranSFormer against the stock transformer: without its S-GCN it is the
same network (same weights from the same seed, same outputs, forward and gradients), in
pre-norm and in post-norm, so a quality gap between them comes from the S-GCN or the
norm placement, not from the implementation."""

import argparse

import pytest
import torch

from fairseq.models import ARCH_CONFIG_REGISTRY
from fairseq.models.transformer import TransformerModel
from tests.models.slowfast.test_slowfast_modules import _batch, _dictionary, build_model

SENTENCES = ["a swi@@ ss bicy@@ cle", "the dog runs fast@@ er the dog"]


def _stock_transformer(d, normalize_before: bool):
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    TransformerModel.add_args(parser)
    args = parser.parse_args([])
    sizes = dict(
        encoder_layers=2, decoder_layers=1, encoder_embed_dim=24, decoder_embed_dim=24,
        encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32, encoder_attention_heads=2,
        decoder_attention_heads=2, max_source_positions=64, max_target_positions=64, dropout=0.0,
        encoder_normalize_before=normalize_before, decoder_normalize_before=normalize_before,
    )  # fmt: skip
    for k, v in sizes.items():
        setattr(args, k, v)
    ARCH_CONFIG_REGISTRY["transformer"](args)
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    torch.manual_seed(0)
    return TransformerModel.build_model(args, task).double().eval()


def _logits_and_grads(model, names, src, prev):
    lengths = src.ne(model.encoder.padding_idx).sum(1)
    out = model(src, lengths, prev)[0]
    params = dict(model.named_parameters())
    return out, torch.autograd.grad(out.square().sum(), [params[n] for n in names])


@pytest.mark.parametrize("post_norm", [False, True], ids=["pre-norm", "post-norm"])
def test_slow_only_without_sgcn_is_the_stock_transformer(post_norm):
    d = _dictionary()
    slow = build_model(d, no_fast_branch=True, no_slow_word_graph=True, slowfast_post_norm=post_norm).double()
    stock = _stock_transformer(d, normalize_before=not post_norm)
    assert slow.encoder.layers[0].normalize_before is (not post_norm)
    ours = dict(slow.named_parameters())
    theirs = {k: v for k, v in stock.named_parameters() if k in ours}
    assert set(theirs) == set(ours)  # the stock model only adds its fused-kernel copies
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name
    src = _batch(d, SENTENCES)
    prev = _batch(d, ["the dog runs", "a bicy@@ cle"])
    names = sorted(ours)
    out_slow, grads_slow = _logits_and_grads(slow, names, src, prev)
    out_stock, grads_stock = _logits_and_grads(stock, names, src, prev)
    assert torch.allclose(out_slow, out_stock)
    for a, b in zip(grads_slow, grads_stock):
        assert torch.allclose(a, b)


def test_sgcn_and_norm_options():
    d = _dictionary()
    plain = build_model(d, no_fast_branch=True, no_slow_word_graph=True)
    assert all(layer.word_graph is None for layer in plain.encoder.layers)
    post = build_model(d, slowfast_post_norm=True)
    assert post.encoder.layer_norm is None and not post.encoder.fast_layers[0].normalize_before
    with pytest.raises(ValueError, match="slowfast-post-norm"):
        build_model(d, slowfast_post_norm=True, encoder_normalize_before=True)
