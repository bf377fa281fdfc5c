"""bpt_lm / segtree_lm / window_lm / sparse_lm: incremental decoding, causality, the window and
the strided pattern, options."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("fairseq")
from fairseq import options, tasks  # noqa: E402

from tests.cli import USER_DIR  # noqa: E402

VOCAB = 20
TINY_LM_ARGS = [
    "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
    "--decoder-attention-heads", "2", "--dropout", "0", "--tokens-per-sample", "64",
]  # fmt: skip
# the torch backend: "auto" picks the C++ CPU kernel, whose first use in a process may compile it
# (the kernel equals the torch backend by tests/graph_attention/test_cpu_backend.py; the CLI test runs "auto")
ARCHS = {
    "bpt_lm": ["--graph-k", "2", "--graph-attention-backend", "torch"],
    "segtree_lm": ["--graph-attention-backend", "torch"],
    "window_lm": ["--attention-window", "5"],
    "sparse_lm": ["--sparse-stride", "4", "--sparse-summary", "2", "--graph-attention-backend", "torch"],
}


def build(tmp_path: Path, arch: str, extra=(), sizes=TINY_LM_ARGS):
    (tmp_path / "dict.txt").write_text("".join(f"c{i} 1\n" for i in range(VOCAB)))
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        str(tmp_path), "--user-dir", str(USER_DIR), "--task", "language_modeling", "--arch", arch,
        *sizes, *extra,
    ])  # fmt: skip
    task = tasks.setup_task(args)
    torch.manual_seed(0)
    return task, task.build_model(args).eval().double()


def random_text(task, batch, length, seed):
    d = task.source_dictionary
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(d.nspecial, len(d), (batch, length), generator=gen)


def other_symbols(task, tokens):
    """Every token replaced by another non-special symbol."""
    d = task.source_dictionary
    return (tokens - d.nspecial + 1) % (len(d) - d.nspecial) + d.nspecial


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_equals_full(tmp_path, arch):
    """Sampling's step-by-step decoding gives the logits of one full forward, also across a
    reorder of the cache (as beam search does)."""
    task, model = build(tmp_path, arch, ARCHS[arch])
    text = random_text(task, 2, 37, 0)
    full, _ = model(text)
    state = {}
    for t in range(text.size(1)):
        if t == 17:
            for _ in range(2):
                model.decoder.reorder_incremental_state_scripting(state, torch.tensor([1, 0]))
        step, _ = model.decoder(text[:, :t + 1], incremental_state=state)
        torch.testing.assert_close(step[:, 0], full[:, t])


def test_decoding_cache_grows_and_reorders_in_place(tmp_path):
    """bpt_lm's key/value cache is written in place and doubles when full: across a growth, a
    reorder right after it that duplicates a sentence (beam search), and identity reorders
    (sampling) that copy nothing, every step equals the full computation."""
    from fairseq_plugins.graphs.binary_partition import nodes_created
    from fairseq_plugins.modules.bpt.graph_self_attention import INITIAL_CACHE_NODES

    task, model = build(tmp_path, "bpt_lm", ARCHS["bpt_lm"])
    text = random_text(task, 2, 64, 4)
    full, _ = model(text)
    attention = model.decoder.layers[-1].self_attn
    growth = next(t for t in range(64) if nodes_created(t + 1) > INITIAL_CACHE_NODES)
    state, rows, buffers = {}, [0, 1], []
    for t in range(text.size(1)):
        if t == growth + 1:
            model.decoder.reorder_incremental_state_scripting(state, torch.tensor([1, 1]))
            rows = [1, 1]
        model.decoder.reorder_incremental_state_scripting(state, torch.arange(2))
        step, _ = model.decoder(text[rows, :t + 1], incremental_state=state)
        torch.testing.assert_close(step[:, 0], full[rows, t])
        buffers.append(attention._get_input_buffer(state)["key_cache"])
    assert buffers[growth - 1].size(2) == INITIAL_CACHE_NODES and buffers[-1].size(2) == 2 * INITIAL_CACHE_NODES
    assert buffers[growth] is not buffers[growth - 1]  # grown
    assert all(b is buffers[0] for b in buffers[:growth]) and buffers[-1] is buffers[growth + 1]  # in place


@pytest.mark.parametrize("arch", ARCHS)
def test_a_future_character_never_changes_the_past(tmp_path, arch):
    task, model = build(tmp_path, arch, ARCHS[arch])
    text = random_text(task, 1, 41, 1)
    logits, _ = model(text)
    for t in [0, 1, 6, 15, 16, 31, 39]:
        changed = text.clone()
        changed[0, t + 1] = other_symbols(task, text[0, t + 1])
        other, _ = model(changed)
        torch.testing.assert_close(other[:, :t + 1], logits[:, :t + 1], rtol=0, atol=0)
        assert not torch.allclose(other[:, t + 1], logits[:, t + 1])


def test_window_reaches_exactly_w_tokens_back_per_layer(tmp_path):
    """One layer with window w: output t depends on tokens t - w + 1 .. t and no others."""
    w = 4
    task, model = build(tmp_path, "window_lm", ["--attention-window", str(w), "--decoder-layers", "1"])
    text = random_text(task, 1, 20, 2)
    logits, _ = model(text)
    t = 12
    for source in range(t + 1):
        changed = text.clone()
        changed[0, source] = other_symbols(task, text[0, source])
        other, _ = model(changed)
        seen = not torch.allclose(other[0, t], logits[0, t])
        assert seen == (source > t - w), source


def test_sparse_lm_reaches_exactly_the_pattern_per_layer(tmp_path):
    """One layer of sparse_lm: output t depends on the tokens of the strided pattern's row t
    (its block up to t, the earlier blocks' summaries) and no others."""
    from fairseq_plugins.graphs.strided import strided_keys

    task, model = build(tmp_path, "sparse_lm", [*ARCHS["sparse_lm"], "--decoder-layers", "1"])
    text = random_text(task, 1, 20, 2)
    logits, _ = model(text)
    t = 14
    keys = set(strided_keys(t, 4, 2).tolist())
    assert keys == {2, 3, 6, 7, 10, 11, 12, 13, 14}
    for source in range(t + 1):
        changed = text.clone()
        changed[0, source] = other_symbols(task, text[0, source])
        other, _ = model(changed)
        assert (not torch.allclose(other[0, t], logits[0, t])) == (source in keys), source


def test_window_as_long_as_the_text_is_transformer_lm(tmp_path):
    task, window = build(tmp_path, "window_lm", ["--attention-window", "64"])
    # fairseq's transformer_lm takes its dataclass defaults (post-norm, d 512 in/out) for what is not given
    _, dense = build(tmp_path, "transformer_lm", ["--decoder-normalize-before", "--decoder-input-dim", "32",
                                                  "--decoder-output-dim", "32"])
    dense.decoder.load_state_dict(window.decoder.state_dict())
    text = random_text(task, 2, 30, 3)
    torch.testing.assert_close(window(text)[0], dense(text)[0])


def test_paper_sizes(tmp_path):
    """The architectures' sizes, each overridable from the command line."""
    _, model = build(tmp_path, "bpt_lm_enwik8", sizes=[])
    assert len(model.decoder.layers) == 12 and model.decoder.embed_dim == 512
    assert int(sum(p.numel() for p in model.parameters()) / 1e6) == 38  # Table 3: 38M (38.6M here)
    _, model = build(tmp_path, "segtree_lm_wikitext2", sizes=[])
    assert len(model.decoder.layers) == 6 and model.decoder.embed_dim == 320
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight  # tied


def test_bad_options_raise(tmp_path):
    with pytest.raises(ValueError, match="k = 1 by definition"):
        build(tmp_path, "segtree_lm", ["--graph-k", "2"])
    with pytest.raises(ValueError, match="graph-k"):
        build(tmp_path, "bpt_lm", ["--graph-k", "0"])
    with pytest.raises(ValueError, match="attention-window"):
        build(tmp_path, "window_lm", ["--attention-window", "0"])
    with pytest.raises(ValueError, match="adaptive-input"):
        build(tmp_path, "bpt_lm", ["--adaptive-input"])
    with pytest.raises(ValueError, match="sparse-summary must be in"):
        build(tmp_path, "sparse_lm", ["--sparse-stride", "4", "--sparse-summary", "5"])


LM_ARCHS = ["bpt_lm", "bpt_lm_enwik8", "bpt_lm_text8", "segtree_lm", "segtree_lm_ptb", "segtree_lm_wikitext2",
            "window_lm", "sparse_lm", "sparse_lm_enwik8"]


@pytest.mark.parametrize("arch", LM_ARCHS)
def test_architectures_fill_only_unset_plugin_options(arch):
    import argparse

    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    from fairseq_plugins.models.bpt_lm import LM_GRAPH_OPTIONS

    sparse = ("sparse_stride", "sparse_summary", "graph_token_positions")
    names = {"window_lm": ("attention_window",), "sparse_lm": sparse,
             "sparse_lm_enwik8": sparse}.get(arch, LM_GRAPH_OPTIONS)
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    ARCH_MODEL_REGISTRY[arch].add_args(parser)
    assert set(names) <= {action.dest for action in parser._actions}
    set_by_user = {name: object() for name in names}
    args = argparse.Namespace(**set_by_user)
    ARCH_CONFIG_REGISTRY[arch](args)
    assert {name: getattr(args, name) for name in names} == set_by_user
    unset = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](unset)
    assert all(getattr(unset, name) is not None for name in names)
