"""The language models' training options (models/lm_training.py) and BPT's objective
(``--criterion aux_layer_cross_entropy``): each dropout where its option says, the defaults
today's (fairseq's) computation, post-norm as BPT's original, the auxiliary loss the mean of the
per-layer losses it names."""

import copy

import pytest
import torch

pytest.importorskip("fairseq")
from fairseq.criterions.cross_entropy import CrossEntropyCriterion  # noqa: E402
from fairseq.modules import FairseqDropout  # noqa: E402

from fairseq_plugins.modules.bpt.graph_transformer import GraphTransformerDecoder  # noqa: E402

from fairseq_plugins.tasks.aux_layer_cross_entropy import AuxLayerCrossEntropyCriterion, aux_layers  # noqa: E402
from tests.tasks.lm.test_lm_models import ARCHS, build, random_text  # noqa: E402

LMS = {**ARCHS, "transformer_lm_matched": []}


def train_logits(model, text, seed=0):
    torch.manual_seed(seed)
    return model.train()(text)[0]


@pytest.mark.parametrize("arch", LMS)
def test_embedding_dropout_drops_the_embeddings_only(tmp_path, arch):
    """--embed-dropout 1: every embedding is zero, so the logits no longer depend on the tokens
    (the graph LMs have no absolute positions; the transformer's positions go through the same
    dropout). --dropout 1 alone leaves the embeddings, which then reach the output unchanged."""
    task, model = build(tmp_path, arch, [*LMS[arch], "--embed-dropout", "1"])
    text = random_text(task, 2, 12, 0)
    other = random_text(task, 2, 12, 1)
    torch.testing.assert_close(train_logits(model, text), train_logits(model, other))
    _, inner = build(tmp_path, arch, [*LMS[arch], "--dropout", "1", "--embed-dropout", "0"])
    assert not torch.allclose(train_logits(inner, text), train_logits(inner, other))


@pytest.mark.parametrize("arch", LMS)
def test_output_dropout_drops_the_last_states(tmp_path, arch):
    """--output-dropout 1: the projection reads zeros (fairseq's output projection has no bias)."""
    task, model = build(tmp_path, arch, [*LMS[arch], "--output-dropout", "1"])
    logits = train_logits(model, random_text(task, 2, 12, 0))
    assert torch.count_nonzero(logits) == 0
    assert torch.count_nonzero(model.eval()(random_text(task, 2, 12, 0))[0]) > 0  # training only


@pytest.mark.parametrize("arch", LMS)
def test_defaults_are_the_single_rate(tmp_path, arch):
    """Unset, the embeddings drop at --dropout and the output not at all: the same random draws
    and the same logits as the options spelled out, and as fairseq's own decoder."""
    task, model = build(tmp_path, arch, [*LMS[arch], "--dropout", "0.3"])
    _, spelled = build(tmp_path, arch, [*LMS[arch], "--dropout", "0.3", "--embed-dropout", "0.3",
                                        "--output-dropout", "0"])
    assert model.decoder.dropout_module.p == 0.3 and model.decoder.output_dropout.p == 0
    assert model.decoder.dropout_module.norm is None
    text = random_text(task, 2, 12, 0)
    torch.testing.assert_close(train_logits(model, text), train_logits(spelled, text))
    _, other = build(tmp_path, arch, [*LMS[arch], "--dropout", "0.3", "--embed-dropout", "0.5"])
    assert not torch.allclose(train_logits(model, text), train_logits(other, text))


@pytest.mark.parametrize("arch", ["bpt_lm", "segtree_lm"])
def test_graph_lm_defaults_are_the_translation_decoder(tmp_path, arch):
    """The graph LMs' decoder with the defaults computes what the shared GraphTransformerDecoder
    (the translation models' decoder, the LMs' before these options) computes, dropout draws included."""
    task, model = build(tmp_path, arch, [*ARCHS[arch], "--dropout", "0.3"])
    today = copy.deepcopy(model)
    today.decoder.__class__ = GraphTransformerDecoder
    today.decoder.dropout_module = FairseqDropout(0.3)
    text = random_text(task, 2, 12, 0)
    torch.testing.assert_close(train_logits(model, text), train_logits(today, text))


def test_matched_transformer_is_fairseqs_transformer_lm(tmp_path):
    """transformer_lm_matched with its defaults computes what fairseq's transformer_lm computes,
    dropout draws included."""
    task, matched = build(tmp_path, "transformer_lm_matched", ["--dropout", "0.3"])
    _, stock = build(tmp_path, "transformer_lm", ["--dropout", "0.3", "--decoder-normalize-before",
                                                  "--decoder-input-dim", "32", "--decoder-output-dim", "32"])
    stock.load_state_dict({k: v for k, v in matched.state_dict().items() if k != "dictionary_fingerprint"})
    text = random_text(task, 2, 12, 0)
    torch.testing.assert_close(train_logits(matched, text), train_logits(stock, text))


@pytest.mark.parametrize("arch", LMS)
def test_post_norm_as_the_bpt_original(tmp_path, arch):
    """--post-norm: every layer normalises after its sub-layers, no final norm, and a layer norm
    on the dropped-out embeddings: with the embedding dropout at 1 the first layer reads the
    norm's bias."""
    task, model = build(tmp_path, arch, [*LMS[arch], "--post-norm"])
    assert not any(layer.normalize_before for layer in model.decoder.layers)
    assert model.decoder.layer_norm is None and model.decoder.dropout_module.norm is not None
    torch.nn.init.normal_(model.decoder.dropout_module.norm.bias)
    embed = model.decoder.dropout_module
    embed.p = 1.0
    x = torch.randn(3, 5, model.decoder.embed_dim, dtype=torch.float64)
    torch.testing.assert_close(embed.train()(x), embed.norm.bias.expand_as(x))
    with pytest.raises(ValueError, match="drop --layernorm-embedding"):
        build(tmp_path, arch, [*LMS[arch], "--post-norm", "--layernorm-embedding"])


def test_bad_rates_raise(tmp_path):
    with pytest.raises(ValueError, match="give a rate in"):
        build(tmp_path, "bpt_lm", [*ARCHS["bpt_lm"], "--output-dropout", "1.5"])


def test_aux_layers_follow_the_original_schedule():
    """lm.py: aux = epoch / n_epochs, layer i + 1 kept when (i + 1) > n_layers * aux."""
    for layers, stages in ((12, 72), (6, 4), (3, 7)):
        for stage in range(stages):
            original = [i + 1 for i in range(layers) if (i + 1) > layers * (stage / stages)]
            assert aux_layers(layers, stage, stages) == original
    assert aux_layers(12, 0, 72) == list(range(1, 13)) and aux_layers(12, 71, 72) == [12]


def criterion(task, stages, max_update):
    return AuxLayerCrossEntropyCriterion(task, sentence_avg=False, aux_layer_stages=stages, max_update=max_update)


def sample(text):
    return {"net_input": {"src_tokens": text[:, :-1], "src_lengths": None}, "target": text[:, 1:].contiguous(),
            "ntokens": text[:, 1:].numel()}


def first_layers(model, count):
    """The model cut after ``count`` layers: its output is that layer's readout."""
    cut = copy.deepcopy(model)
    cut.decoder.layers = cut.decoder.layers[:count]
    cut.decoder.num_layers = count
    return cut


@pytest.mark.parametrize("arch", LMS)
def test_aux_loss_is_the_mean_of_the_named_layer_losses(tmp_path, arch):
    """float64, no dropout: each layer's readout is the output of the model cut after that layer
    (to 1e-12), and the criterion's training loss in each stage equals the mean of the summed
    losses of the cut models it names, built here apart from the criterion (in float32 from the
    log-softmax on, as fairseq's get_normalized_probs). In eval mode, and in the last stage, it is
    cross_entropy's loss exactly."""
    task, model = build(tmp_path, arch, [*LMS[arch], "--decoder-layers", "4"])
    text = random_text(task, 3, 11, 0)
    batch = sample(text)
    aux = criterion(task, stages=4, max_update=40)

    def layer_loss(count):
        logits = first_layers(model, count).train()(batch["net_input"]["src_tokens"])[0]
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["target"].flatten(),
                                                 reduction="sum")

    states = model.train()(batch["net_input"]["src_tokens"])[1]["inner_states"]
    for count in range(1, 5):
        torch.testing.assert_close(model.decoder.layer_output(states[count]),
                                   first_layers(model, count)(batch["net_input"]["src_tokens"])[0],
                                   rtol=1e-12, atol=1e-12)

    for updates, named in ((0, [1, 2, 3, 4]), (9, [1, 2, 3, 4]), (10, [2, 3, 4]), (25, [3, 4]), (39, [4]), (90, [4])):
        model.set_num_updates(updates)
        loss, size, _ = aux(model.train(), batch)
        expected = sum(layer_loss(count) for count in named) / len(named)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        assert size == batch["ntokens"]
    cross_entropy = CrossEntropyCriterion(task, sentence_avg=False)
    model.set_num_updates(0)
    assert aux(model.eval(), batch)[0] == cross_entropy(model.eval(), batch)[0]
    model.set_num_updates(39)
    assert aux(model.train(), batch)[0] == cross_entropy(model.train(), batch)[0]


def test_aux_loss_refuses_what_it_cannot_schedule(tmp_path):
    task, model = build(tmp_path, "transformer_lm", ["--decoder-input-dim", "32", "--decoder-output-dim", "32"])
    with pytest.raises(ValueError, match="max-update"):
        criterion(task, stages=4, max_update=0)
    with pytest.raises(ValueError, match="aux-layer-stages"):
        criterion(task, stages=0, max_update=10)
    with pytest.raises(ValueError, match="plugin's language models"):
        criterion(task, stages=4, max_update=10)(model.train(), sample(random_text(task, 2, 8, 0)))
