"""The plugin models' options: one dataclass per model, the same flags on the argparse path,
architectures that only fill what is unset, clear errors instead of silent replacements, the
BPT paper options (and plugin v1's behaviour for configs saved by it), and the graph attention
backend reaching the op."""

import argparse

import pytest
import torch
from omegaconf import OmegaConf

from fairseq import options, tasks
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY, FairseqLanguageModel

from fairseq_plugins.models import bpt_transformer
from fairseq_plugins.models.bpt_transformer import GraphTransformerConfig
from fairseq_plugins.models.model_options import own_fields
from tests.cli import TINY_MODEL_ARGS, USER_DIR


# the translation models; the language models' options: tests/tasks/lm/test_lm_models.py
PLUGIN_ARCHS = sorted(a for a, cls in ARCH_MODEL_REGISTRY.items()
                      if cls.__module__.startswith("fairseq_plugins.") and not issubclass(cls, FairseqLanguageModel))
VOCAB = 30


def _config_cls(arch):
    """The model's options dataclass, found through its add_args (None: fairseq's own)."""
    import fairseq_plugins.models.model_options as mo

    seen = []
    original = mo.gen_parser_from_dataclass
    mo.gen_parser_from_dataclass = lambda parser, instance, **kw: seen.append(type(instance))
    try:
        ARCH_MODEL_REGISTRY[arch].add_args(argparse.ArgumentParser())
    finally:
        mo.gen_parser_from_dataclass = original
    return seen[0] if seen else None


def build(tmp_path, arch, *extra):
    for lang in ("en", "de"):
        (tmp_path / f"dict.{lang}.txt").write_text("".join(f"w{i} 1\n" for i in range(VOCAB)))
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        str(tmp_path), "--user-dir", str(USER_DIR), "--task", "translation", "-s", "en", "-t", "de",
        "--arch", arch, *TINY_MODEL_ARGS, "--dropout", "0", "--max-source-positions", "64", *extra,
    ])  # fmt: skip
    task = tasks.setup_task(args)
    torch.manual_seed(0)
    return task, task.build_model(args).eval().double()


@pytest.mark.parametrize("arch", PLUGIN_ARCHS)
def test_architectures_only_fill_unset_options(arch):
    config_cls = _config_cls(arch)
    if config_cls is None:
        pytest.skip(f"{arch} has fairseq's transformer options only")
    set_by_user = {f.name: object() for f in own_fields(config_cls)}
    args = argparse.Namespace(**set_by_user)
    ARCH_CONFIG_REGISTRY[arch](args)
    assert {name: getattr(args, name) for name in set_by_user} == set_by_user
    unset = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](unset)
    # None on purpose: no sentencepiece model; the embedding dropout resolved from --dropout at build
    unset_on_purpose = ("fast_sentencepiece_model", "fast_sentencepiece_pieces", "embed_dropout")
    assert all(getattr(unset, name) is not None or name in unset_on_purpose for name in set_by_user)


@pytest.mark.parametrize("arch", PLUGIN_ARCHS)
def test_every_option_has_a_flag(arch):
    config_cls = _config_cls(arch)
    if config_cls is None:
        pytest.skip(f"{arch} has fairseq's transformer options only")
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    ARCH_MODEL_REGISTRY[arch].add_args(parser)
    dests = {action.dest for action in parser._actions}
    assert {f.name for f in own_fields(config_cls)} <= dests
    assert {"encoder_embed_dim", "decoder_layers", "share_all_embeddings"} <= dests  # fairseq's, flat


@pytest.mark.parametrize("extra, message", [
    (["--graph-k", "0"], "--graph-k must be an integer >= 1, got 0"),
    (["--graph-rel-clip", "0"], "--graph-rel-clip must be an integer >= 1, got 0"),
])  # fmt: skip
def test_zero_is_an_error_not_the_default(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        build(tmp_path, "bpt_transformer", *extra)


def test_segtree_k_is_one(tmp_path):
    with pytest.raises(ValueError, match="SegTree's graph has k = 1"):
        build(tmp_path, "segtree_transformer", "--graph-k", "4")
    _, model = build(tmp_path, "segtree_transformer")
    assert model.encoder._spec.k == 1


def test_multiscale_options_are_errors_not_defaults(tmp_path):
    with pytest.raises(ValueError, match="--multiscale-block-size must be an integer >= 1, got 0"):
        build(tmp_path, "ms_transformer", "--multiscale-block-size", "0")
    with pytest.raises(ValueError, match="--scale-candidates is empty"):
        build(tmp_path, "ms_transformer", "--scale-candidates", "")


def test_hydra_values_are_checked_like_argparse_choices():
    """fairseq-hydra-train hands the model an OmegaConf node that argparse never checked."""
    from fairseq_plugins.models.bpt_transformer import BPTTransformerModel

    cfg = OmegaConf.create({"_name": "bpt_transformer", "graph_sides": "left"})
    ARCH_CONFIG_REGISTRY["bpt_transformer"](cfg)
    task = argparse.Namespace(source_dictionary=None, target_dictionary=None)
    with pytest.raises(ValueError, match="--graph-sides 'left': choose from encoder, decoder, both"):
        BPTTransformerModel.build_model(cfg, task)


def test_multiscale_prefixed_options_reach_the_config():
    """TransformerConfig files encoder_*/decoder_* names under its sub-configs: the plugin's own
    fields with those prefixes must still read back what was set."""
    from fairseq_plugins.models.ms_transformer import MultiScaleTransformerConfig

    cfg = MultiScaleTransformerConfig.from_namespace(OmegaConf.create(
        {"encoder_scales": "1,3", "decoder_self_attention": "multiscale", "encoder_embed_dim": 64}))
    assert (cfg.encoder_scales, cfg.decoder_self_attention, cfg.encoder_embed_dim) == ("1,3", "multiscale", 64)


def test_paper_options_are_the_default_and_v1_configs_keep_theirs():
    fresh = argparse.Namespace()
    ARCH_CONFIG_REGISTRY["bpt_transformer_iwslt_de_en"](fresh)
    assert (fresh.graph_token_positions, fresh.graph_cross_attention) == ("none", "tokens")
    saved_by_v1 = argparse.Namespace(graph_kind="bpt", graph_k=2, graph_rel_clip=2, graph_sides="both")
    ARCH_CONFIG_REGISTRY["bpt_transformer"](saved_by_v1)
    assert (saved_by_v1.graph_token_positions, saved_by_v1.graph_cross_attention) == ("absolute", "nodes")


@pytest.mark.parametrize("positions", ["none", "absolute"])
def test_token_positions(tmp_path, positions):
    _, model = build(tmp_path, "bpt_transformer", "--graph-token-positions", positions)
    for side in (model.encoder, model.decoder):
        assert (side.embed_positions is None) == (positions == "none")
    _, one_sided = build(tmp_path, "bpt_transformer", "--graph-sides", "encoder")
    assert one_sided.encoder.embed_positions is None and one_sided.decoder.embed_positions is not None


def _tokens(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (2, n), generator=gen)


@pytest.mark.parametrize("normalize_before", [False, True])
def test_cross_attention_from_tokens_leaves_spans_alone(tmp_path, normalize_before):
    """With --graph-cross-attention tokens a decoder span node's state after a layer does not
    depend on the source; with nodes (plugin v1) it does. Token nodes depend on it in both."""
    norm = ["--decoder-normalize-before"] if normalize_before else []
    prev, length = _tokens(9, 1), 9
    for mode in ("tokens", "nodes"):
        _, model = build(tmp_path, "bpt_transformer", "--graph-cross-attention", mode, *norm)
        layer_out = []
        model.decoder.layers[0].register_forward_hook(lambda _m, _a, out, record=layer_out.append: record(out[0]))
        for seed in (2, 3):
            model.decoder(prev, encoder_out=model.encoder(_tokens(7, seed), src_lengths=torch.tensor([7, 7])))
        first, second = layer_out
        assert first.size(0) > length  # span nodes follow the tokens
        assert not torch.allclose(first[:length], second[:length])
        assert torch.allclose(first[length:], second[length:]) == (mode == "tokens")


@pytest.mark.parametrize("mode", ["tokens", "nodes"])
def test_incremental_decoding_equals_full_sequence(tmp_path, mode):
    _, model = build(tmp_path, "bpt_transformer", "--graph-k", "2", "--graph-cross-attention", mode)
    src, prev = _tokens(10, 0), _tokens(13, 1)
    encoder_out = model.encoder(src, src_lengths=torch.tensor([10, 10]))
    full, _ = model.decoder(prev, encoder_out=encoder_out)
    state = {}
    for t in range(prev.size(1)):
        step, _ = model.decoder(prev[:, :t + 1], encoder_out=encoder_out, incremental_state=state)
        torch.testing.assert_close(step[:, 0], full[:, t])


@pytest.mark.parametrize("arch", ["bpt_transformer", "segtree_transformer"])
def test_backend_choice_reaches_the_op(tmp_path, monkeypatch, arch):
    """--graph-attention-backend is what every graph self-attention passes to graph_attention."""
    from fairseq_plugins.modules.bpt import graph_self_attention

    calls = []
    real = graph_self_attention.graph_attention

    def spy(*args, backend, **kwargs):
        calls.append(backend)
        return real(*args, backend="torch", **kwargs)

    monkeypatch.setattr(graph_self_attention, "graph_attention", spy)
    _, model = build(tmp_path, arch, "--graph-attention-backend", "flex")
    model(_tokens(6, 0), torch.tensor([6, 6]), _tokens(5, 1))
    assert calls and set(calls) == {"flex"}


def test_backend_is_validated(tmp_path):
    with pytest.raises(SystemExit):  # argparse: invalid choice
        build(tmp_path, "bpt_transformer", "--graph-attention-backend", "fast")
    cfg = GraphTransformerConfig(graph_attention_backend="fast")
    cfg.graph_kind = "bpt"
    with pytest.raises(ValueError, match="--graph-attention-backend 'fast'"):
        bpt_transformer.validate_graph_options(cfg)
