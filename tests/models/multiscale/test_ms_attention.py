"""Multi-scale window attention: the banded op against the dense reference, the reference
against plain attention, padding invariance, and the fairseq-facing module."""

import pytest
import torch
import torch.nn.functional as F

from fairseq.modules import MultiheadAttention
from fairseq_plugins.modules.multiscale.multiscale_attention import (
    MultiScaleSelfAttention,
    Scale,
    multiscale_attention,
    multiscale_attention_reference,
    parse_scales,
)

SCALES = parse_scales("1,3,5,N/4,N/2,all")
HEADS = len(SCALES)  # one head per scale


def _qkv(batch=3, heads=HEADS, length=37, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, dim, generator=gen, dtype=torch.float64) for _ in range(3)]


def _padding(batch, length):
    """Row 0 unpadded, row 1 left-padded (encoder style), row 2 right-padded (decoder style)."""
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[1, :6] = True
    pad[2, -9:] = True
    return pad


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 7, 64])
def test_banded_equals_dense_reference_forward_and_backward(causal, block_size):
    q, k, v = _qkv()
    pad = _padding(3, 37)
    real = ~pad[:, None, :, None]
    for x in (q, k, v):
        x.requires_grad_(True)
    ref, _ = multiscale_attention_reference(q, k, v, SCALES, pad, causal)
    ref_grads = torch.autograd.grad((ref * real).square().sum(), (q, k, v))
    out = multiscale_attention(q, k, v, SCALES, pad, causal, block_size=block_size)
    grads = torch.autograd.grad((out * real).square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad)


def test_banded_path_is_used_for_long_sequences_and_matches():
    """At n=300 with small windows the op goes through the unfold path (span < n)."""
    scales = parse_scales("1,3,N/16,N/8")
    q, k, v = _qkv(batch=2, heads=4, length=300, dim=4)
    pad = torch.zeros(2, 300, dtype=torch.bool)
    pad[1, :40] = True
    for causal in (False, True):
        ref, _ = multiscale_attention_reference(q, k, v, scales, pad, causal)
        out = multiscale_attention(q, k, v, scales, pad, causal, block_size=32)
        torch.testing.assert_close(out[:, :, 40:], ref[:, :, 40:])
        torch.testing.assert_close(out[0], ref[0])


def test_reference_weights_follow_the_window_definition():
    """Non-zero weights exactly where |i - j| <= r, r = (omega - 1) / 2, omega from N."""
    length = 40  # N/4 -> omega 11 (r 5), N/16 -> omega 3 (r 1), 7 -> r 3
    scales = parse_scales("7,N/4,N/16,all")
    q, k, v = _qkv(batch=1, heads=4, length=length)
    _, weights = multiscale_attention_reference(q, k, v, scales)
    pos = torch.arange(length)
    distance = (pos[:, None] - pos[None, :]).abs()
    for head, radius in enumerate([3, 5, 1, length]):
        assert torch.equal(weights[0, head] > 0, distance <= radius), scales[head]
    _, causal_weights = multiscale_attention_reference(q, k, v, scales, causal=True)
    offset = pos[None, :] - pos[:, None]
    # causal N counts the tokens seen so far: query i has N = i + 1
    for head, radius in enumerate([torch.full_like(pos, 3), (pos + 1) // 8, (pos + 1) // 32, pos + 1]):
        expected = (offset <= 0) & (offset >= -radius[:, None])
        assert torch.equal(causal_weights[0, head] > 0, expected), scales[head]


def test_whole_sentence_heads_equal_plain_attention():
    q, k, v = _qkv(heads=2)
    pad = _padding(3, 37)
    scales = [Scale(), Scale()]
    out, _ = multiscale_attention_reference(q, k, v, scales, pad)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :])
    real = ~pad[:, None, :, None]
    torch.testing.assert_close(out * real, expected * real)
    out, _ = multiscale_attention_reference(q[:1], k[:1], v[:1], scales, causal=True)
    expected = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], is_causal=True)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_never_changes_a_result(causal):
    """Each sentence alone gives the same output as inside a padded batch."""
    lengths = [37, 12, 25]
    q, k, v = _qkv(length=37)
    pad = torch.ones(3, 37, dtype=torch.bool)
    singles = []
    for row, n in enumerate(lengths):
        # left padding for the encoder, right padding for the decoder, as fairseq does
        span = slice(37 - n, 37) if not causal else slice(0, n)
        pad[row, span] = False
        single = multiscale_attention(q[row : row + 1, :, span], k[row : row + 1, :, span],
                                      v[row : row + 1, :, span], SCALES, causal=causal, block_size=4)  # fmt: skip
        singles.append((span, single[0]))
    batched = multiscale_attention(q, k, v, SCALES, pad, causal, block_size=4)
    for row, (span, single) in enumerate(singles):
        torch.testing.assert_close(batched[row, :, span], single)


def test_scale_parsing_and_rounding_to_odd():
    assert [str(s) for s in parse_scales(" 1, 3,N/16 ,N,all")] == ["1", "3", "N/16", "N", "all"]
    lengths = torch.tensor([1, 20, 31, 32, 47, 48])
    # N/16: N/16 rounded to the nearest odd width (ties up); r = floor(N / 32)
    assert Scale.parse("N/16").radius(lengths).tolist() == [0, 0, 0, 1, 1, 1]
    assert Scale.parse("N/4").radius(lengths).tolist() == [0, 2, 3, 4, 5, 6]
    assert Scale.parse("5").radius(lengths).tolist() == [2] * 6
    for bad in ["4", "N/0", "N/x", "", "0.5N", "-3"]:
        with pytest.raises(ValueError):
            Scale.parse(bad)


def test_bad_inputs_are_refused():
    q, k, v = _qkv(heads=2)
    with pytest.raises(ValueError, match="2 heads but 6 scales"):
        multiscale_attention(q, k, v, SCALES)
    with pytest.raises(ValueError, match="key_padding_mask"):
        multiscale_attention(q, k, v, SCALES[:2], key_padding_mask=torch.zeros(3, 5, dtype=torch.bool))


def _module(scales, causal, seed=0):
    torch.manual_seed(seed)
    return MultiScaleSelfAttention(16, parse_scales(scales), causal=causal).double().eval()


def test_module_matches_fairseq_multihead_attention_when_every_head_sees_all():
    ms = _module("all,all,all,all", causal=False)
    stock = MultiheadAttention(16, 4, self_attention=True).double().eval()
    stock.load_state_dict(ms.state_dict())
    x = torch.randn(9, 2, 16, dtype=torch.float64)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, :3] = True
    out, _ = ms(x, x, x, key_padding_mask=pad, need_weights=False)
    expected, _ = stock(x, x, x, key_padding_mask=pad, need_weights=False)
    torch.testing.assert_close(out[:, 0], expected[:, 0])
    torch.testing.assert_close(out[3:, 1], expected[3:, 1])


def test_module_weights_and_refusals():
    ms = _module("1,3,N/2,all", causal=False)
    x = torch.randn(9, 2, 16, dtype=torch.float64)
    out, weights = ms(x, x, x, need_weights=True)
    fast, _ = ms(x, x, x, need_weights=False)
    torch.testing.assert_close(out, fast)
    assert weights.shape == (2, 9, 9)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 9, dtype=torch.float64))
    _, head_weights = ms(x, x, x, need_head_weights=True)
    assert head_weights.shape == (4, 2, 9, 9)
    assert torch.count_nonzero(head_weights[0]) == 2 * 9  # width 1: each token sees itself
    with pytest.raises(ValueError, match="attn_mask"):
        ms(x, x, x, attn_mask=torch.zeros(9, 9))
    with pytest.raises(ValueError, match="self-attention"):
        ms(x, x.clone(), x.clone())
    with pytest.raises(ValueError, match="causal"):
        ms(x, x, x, incremental_state={})


def test_incremental_decoding_matches_full_causal_pass_and_reorders():
    ms = _module("1,3,N/2,all", causal=True)
    x = torch.randn(7, 3, 16, dtype=torch.float64)
    full, _ = ms(x, x, x, need_weights=False)
    state = {}
    steps = []
    for t in range(7):
        step = x[t : t + 1]
        out, _ = ms(step, step, step, incremental_state=state, need_weights=False)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps), full)

    # beam search reorders the cache: continuing with rows (2, 0, 0) equals recomputing
    order = torch.tensor([2, 0, 0])
    ms.reorder_incremental_state(state, order)
    nxt = torch.randn(1, 3, 16, dtype=torch.float64)
    out, _ = ms(nxt, nxt, nxt, incremental_state=state, need_weights=False)
    seq = torch.cat([x[:, order], nxt])
    expected, _ = ms(seq, seq, seq, need_weights=False)
    torch.testing.assert_close(out[0], expected[-1])


def test_incremental_decoding_with_padding_in_the_prefix():
    """Right-padded prefixes (a finished hypothesis) count only real tokens in N."""
    ms = _module("N/2,N/2,3,all", causal=True)
    x = torch.randn(6, 2, 16, dtype=torch.float64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 2:4] = True
    full, _ = ms(x, x, x, key_padding_mask=pad, need_weights=False)
    state = {}
    for t in range(6):
        step = x[t : t + 1]
        out, _ = ms(step, step, step, key_padding_mask=pad[:, t : t + 1], incremental_state=state,
                    need_weights=False)  # fmt: skip
        real = ~pad[:, t]
        torch.testing.assert_close(out[0][real], full[t][real])
