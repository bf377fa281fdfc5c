"""TranSFormer + ODE (Table 1): the ODE Transformer's RK2 block against hand-written float64
references, in the encoder, and through fairseq-train / fairseq-generate."""

import pytest
import torch

from fairseq_plugins.modules.slowfast.ode_block import RK2Gate, rk2_step
from tests.cli import hypotheses, train_and_translate
from tests.models.slowfast.test_slowfast_modules import _batch, _dictionary, build_model


def _summary(x):
    """One number per sentence (tensors are time x batch x channels, of different lengths)."""
    return x.mean(0, keepdim=True).sum(-1, keepdim=True)


def _toy_block(w1, w2):
    """A two-tensor residual block whose tensors read each other, like the two branches."""
    def block(state):
        a, b = state
        return [a + torch.tanh(a @ w1 + _summary(b)), b + torch.sin(b @ w2) * _summary(a)]
    return block


def _reference_rk2(a, b, w1, w2, gate=None):
    """y + (F1 + F2) / 2 written out for the toy block, F2 = F(y + F1)."""
    def f(a, b):
        return torch.tanh(a @ w1 + _summary(b)), torch.sin(b @ w2) * _summary(a)
    f1a, f1b = f(a, b)
    f2a, f2b = f(a + f1a, b + f1b)
    if gate is None:
        return a + (f1a + f2a) / 2, b + (f1b + f2b) / 2
    g = torch.sigmoid(torch.cat([f1a, f2a], -1) @ gate.linear.weight.t() + gate.linear.bias)
    return a + g * f1a + (1 - g) * f2a, b + (f1b + f2b) / 2


@pytest.mark.parametrize("gated", [False, True])
def test_rk2_step_equals_the_hand_written_block_forward_and_gradient(gated):
    torch.manual_seed(0)
    a, b = torch.randn(3, 2, 4, dtype=torch.double), torch.randn(5, 2, 3, dtype=torch.double)
    w1, w2 = torch.randn(4, 4, dtype=torch.double), torch.randn(3, 3, dtype=torch.double)
    gate = RK2Gate(4).double() if gated else None
    if gated:
        torch.nn.init.normal_(gate.linear.bias)  # not the 1/2 of a zero gate
    leaves = [t.requires_grad_() for t in (a, b, w1, w2)]
    ours = rk2_step(_toy_block(w1, w2), [a, b], [gate, None])
    ref = _reference_rk2(a, b, w1, w2, gate)
    for o, r in zip(ours, ref):
        assert torch.allclose(o, r, atol=1e-12)
    weights = [torch.randn_like(o) for o in ours]
    g_ours = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ours, weights)), leaves)
    g_ref = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)), leaves)
    for go, gr in zip(g_ours, g_ref):
        assert torch.allclose(go, gr, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: rk2_step(_toy_block(w1, w2), [a, b], [gate, None]), (a, b))


def test_the_encoder_solves_each_block_with_rk2_in_float64():
    """Layer by layer, the RK2 encoder is y + (F1 + F2)/2 with F = block - identity, where the
    block is the plain (Euler) encoder's own block i on both branches."""
    d = _dictionary()
    rk2 = build_model(d, slowfast_ode_block="rk2").double()
    euler = build_model(d, slowfast_ode_block="euler").double()
    euler.load_state_dict(rk2.state_dict())
    src = _batch(d, ["a swi@@ ss bicy@@ cle runs", "the dog"])
    enc = euler.encoder
    mask = src.eq(d.pad())
    xs, _ = enc.forward_embedding(src)
    xs = (xs * ~mask.unsqueeze(-1)).transpose(0, 1)
    fast, groups, xf = enc.fast_branch_groups(src)
    from fairseq_plugins.modules.slowfast.word_graph_convolution import WordGraph

    graph = WordGraph(fast.subword_word_ids)
    for i in range(len(enc.layers)):
        def block(xs, xf, i=i):
            return enc.forward_block(i, xs, xf, mask, graph, fast, groups)

        s1, f1 = block(xs, xf)
        k1s, k1f = s1 - xs, [a - b for a, b in zip(f1, xf)]
        s2, f2 = block(xs + k1s, [a + k for a, k in zip(xf, k1f)])
        k2s = s2 - xs - k1s
        k2f = [a - b - k for a, b, k in zip(f2, xf, k1f)]
        xs = xs + (k1s + k2s) / 2
        xf = [x + (p + q) / 2 for x, p, q in zip(xf, k1f, k2f)]
    expected = enc.layer_norm(xs)
    ours = rk2.encoder(src)["encoder_out"][0]
    assert torch.allclose(ours, expected, atol=1e-10)
    assert not torch.allclose(ours, euler.encoder(src)["encoder_out"][0], atol=1e-3)


def test_gated_rk2_adds_one_gate_per_branch_and_trains_it():
    d = _dictionary()
    plain, gated = build_model(d), build_model(d, slowfast_ode_block="rk2-gated")
    extra = sum(p.numel() for p in gated.parameters()) - sum(p.numel() for p in plain.parameters())
    assert extra == (2 * 24 + 1) + (2 * 8 + 1)
    gated.train()
    src = _batch(d, ["a swi@@ ss bicy@@ cle runs", "the dog"])
    gated.encoder(src)["encoder_out"][0].sum().backward()
    assert all(g.linear.weight.grad.abs().sum() > 0 for g in (gated.encoder.slow_ode_gate, gated.encoder.fast_ode_gate))
    slow_only = build_model(d, slowfast_ode_block="rk2-gated", no_fast_branch=True)
    assert slow_only.encoder.fast_ode_gate is None
    slow_only.encoder(src)["encoder_out"][0].sum().backward()
    assert slow_only.encoder.slow_ode_gate.linear.weight.grad.abs().sum() > 0


def test_ode_blocks_need_both_branches():
    with pytest.raises(ValueError, match="--slowfast-ode-block"):
        build_model(_dictionary(), slowfast_ode_block="rk2", no_slow_branch=True)


@pytest.mark.slow
def test_rk2_transformer_trains_and_translates(tiny_data_bin, tmp_path):
    extra = ["--fast-embed-dim", "16", "--fast-attention-heads", "2", "--slowfast-ode-block", "rk2-gated"]
    result = train_and_translate(tiny_data_bin, tmp_path / "ckpt", "transformer_slowfast", extra, max_update=10)
    assert "slowfast_ode_block='rk2-gated'" in result["train_log"]
    assert len(hypotheses(result["generate_out"])) == 40
    assert len(hypotheses(result["interactive_out"])) == 2
