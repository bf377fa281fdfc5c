"""``--checkpoint-activations`` reaches the plugin's own layers (fairseq wraps only the layers it
builds itself) and recomputes them in the backward without changing a gradient; so does
``--graph-recompute-norms-ffn`` (the graph layers' FFN, chunk by chunk), alone and with it."""

import pytest
import torch

pytest.importorskip("fairseq")

from fairseq_plugins.modules.common import recompute as recompute_module  # noqa: E402
from tests.models.bpt import test_bpt_models  # noqa: E402
from tests.tasks.lm import test_lm_models  # noqa: E402


def _builders():
    """(name, build(tmp_path, extra) -> (task, model), a batch's forward inputs)."""
    def lm(arch, backend_args):
        def build(tmp_path, extra):
            return test_lm_models.build(tmp_path, arch, [*backend_args, *extra])

        def inputs(task):
            return (test_lm_models.random_text(task, 2, 23, 0),)
        return build, inputs

    def translation(arch):
        def build(tmp_path, extra):
            return test_bpt_models.build(tmp_path, arch, ["--graph-attention-backend", "torch", *extra])

        def inputs(task):
            src = test_bpt_models.random_tokens(task, [9, 6], 0, left_pad=False)
            tgt = test_bpt_models.random_tokens(task, [7, 5], 1, left_pad=False)
            return src, torch.tensor([9, 6]), tgt
        return build, inputs

    return {
        "bpt_lm": lm("bpt_lm", test_lm_models.ARCHS["bpt_lm"]),
        "segtree_lm": lm("segtree_lm", test_lm_models.ARCHS["segtree_lm"]),
        "bpt_transformer": translation("bpt_transformer"),
        "segtree_transformer": translation("segtree_transformer"),
    }


BUILDERS = _builders()


def _layers(model):
    encoder = getattr(model, "encoder", None)
    return [*getattr(encoder, "layers", []), *model.decoder.layers]


def _gradients(model, inputs):
    model.train()
    model.zero_grad()
    logits, _ = model(*inputs)
    (logits.sin().sum()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(plain, other, batch):
    """``other`` (given ``plain``'s weights) gives ``plain``'s outputs and every gradient."""
    other.load_state_dict(plain.state_dict())
    out, grads = _gradients(plain, batch)
    out_other, grads_other = _gradients(other, batch)
    torch.testing.assert_close(out_other, out)
    assert grads_other.keys() == grads.keys() and grads
    for key in grads:
        torch.testing.assert_close(grads_other[key], grads[key], msg=key)


@pytest.mark.parametrize("name", BUILDERS)
def test_checkpointed_layers_give_the_same_gradients(tmp_path, name):
    build, inputs = BUILDERS[name]
    task, plain = build(tmp_path, [])
    _, checkpointed = build(tmp_path, ["--checkpoint-activations"])
    assert all(not hasattr(layer, "precheckpoint_forward") for layer in _layers(plain))
    assert all(hasattr(layer, "precheckpoint_forward") for layer in _layers(checkpointed))
    assert_same_gradients(plain, checkpointed, inputs(task))


def _graph_layers(model):
    return [layer for layer in _layers(model) if hasattr(layer, "recompute_norms_ffn")]


@pytest.mark.parametrize("checkpointed", [False, True], ids=["alone", "with-checkpoint-activations"])
@pytest.mark.parametrize("name", BUILDERS)
def test_recomputed_ffn_gives_the_same_gradients(tmp_path, monkeypatch, name, checkpointed):
    monkeypatch.setattr(recompute_module, "CHUNK_ELEMENTS", 256)  # several chunks of rows per FFN
    build, inputs = BUILDERS[name]
    task, plain = build(tmp_path, [])
    extra = ["--checkpoint-activations"] if checkpointed else []
    _, recomputed = build(tmp_path, ["--graph-recompute-norms-ffn", *extra])
    assert _graph_layers(plain) and not any(layer.recompute_norms_ffn for layer in _graph_layers(plain))
    assert all(layer.recompute_norms_ffn for layer in _graph_layers(recomputed))
    assert_same_gradients(plain, recomputed, inputs(task))
