"""bpt_transformer / segtree_transformer: padding, causality, incremental decoding, CLI."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("fairseq")
from fairseq import options, tasks  # noqa: E402

from tests.cli import TINY_MODEL_ARGS, USER_DIR, train_and_translate  # noqa: E402

VOCAB = 30
ARCHS = ["bpt_transformer", "segtree_transformer"]


def k2(arch):
    """k = 2 where the graph has a k (SegTree's is 1)."""
    return ["--graph-k", "2"] if arch == "bpt_transformer" else []


def build(tmp_path: Path, arch: str, extra=()):
    for lang in ("en", "de"):
        (tmp_path / f"dict.{lang}.txt").write_text("".join(f"w{i} 1\n" for i in range(VOCAB)))
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        str(tmp_path), "--user-dir", str(USER_DIR), "--task", "translation", "-s", "en", "-t", "de",
        "--arch", arch, *TINY_MODEL_ARGS, "--dropout", "0", "--graph-k", "1",
        "--max-source-positions", "64", *extra,
    ])  # fmt: skip
    task = tasks.setup_task(args)
    torch.manual_seed(0)
    return task, task.build_model(args).eval().double()


def random_tokens(task, lengths, seed, left_pad):
    gen = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    rows = []
    for n in lengths:
        words = (torch.randint(d.nspecial, len(d), (n - 1,), generator=gen).tolist() + [d.eos()])
        pad = [d.pad()] * (max(lengths) - n)
        rows.append(pad + words if left_pad else words + pad)
    return torch.tensor(rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_equals_one_by_one(tmp_path, arch):
    """Padding never changes a result: each sentence decoded alone gives the same outputs."""
    task, model = build(tmp_path, arch)
    src_lengths = [9, 3, 6, 1]
    src = random_tokens(task, src_lengths, 0, left_pad=True)
    tgt_lengths = [5, 7, 2, 4]
    prev = random_tokens(task, tgt_lengths, 1, left_pad=False)
    logits, _ = model(src, torch.tensor(src_lengths), prev)
    for b, (n, m) in enumerate(zip(src_lengths, tgt_lengths)):
        alone, _ = model(src[b:b + 1, -n:], torch.tensor([n]), prev[b:b + 1, :m])
        # fairseq's stock encoder attention alone differs by ~3e-8 in float64 between a padded
        # batch and one sentence on some CPUs (AMD EPYC, torch 2.13); a padding bug is O(1)
        torch.testing.assert_close(logits[b:b + 1, :m], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_out_rows_is_the_first_rows_of_a_full_layer(tmp_path, arch):
    """A layer asked for its first n nodes (the models' last layers: token nodes) returns
    exactly those rows of its full output."""
    from fairseq_plugins.graphs.binary_partition import node_present

    task, model = build(tmp_path, arch)
    n, lengths = 6, torch.tensor([6, 4])
    for side in (model.encoder, model.decoder):
        graph = side._spec.build(n)
        absent = ~node_present(lengths, n)
        x = torch.randn(graph.num_nodes, 2, side.layers[-1].embed_dim, dtype=torch.double)
        if side is model.encoder:
            full, part = (side.layers[-1](x, absent, graph, out_rows=rows) for rows in (None, n))
        else:
            enc = torch.randn(5, 2, side.layers[-1].embed_dim, dtype=torch.double)
            full, part = (side.layers[-1](x, enc, None, graph=graph, self_attn_padding_mask=absent,
                                          num_tokens=n, out_rows=rows)[0] for rows in (None, n))
        assert part.shape == (n, *full.shape[1:])
        torch.testing.assert_close(part, full[:n])


@pytest.mark.parametrize("arch", ARCHS)
def test_first_layers_project_the_equal_span_rows_once(tmp_path, monkeypatch, arch):
    """The span nodes enter the first layers all zero: projecting one of them and repeating it
    gives the outputs and gradients of projecting every row."""
    from fairseq_plugins.modules.bpt import graph_self_attention

    task, model = build(tmp_path, arch)
    model.train()
    src, prev = random_tokens(task, [9, 4], 0, left_pad=True), random_tokens(task, [7, 3], 1, left_pad=False)

    def outputs_and_gradients():
        model.zero_grad()
        logits, _ = model(src, torch.tensor([9, 4]), prev)
        logits.sin().sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    shortcut, used = graph_self_attention.project_rows, []

    def recording(proj, x, equal_rows_from):
        used.append(equal_rows_from)
        return shortcut(proj, x, equal_rows_from)
    monkeypatch.setattr(graph_self_attention, "project_rows", recording)
    fast = outputs_and_gradients()
    assert used.count(9) == 3 and used.count(7) == 3  # the encoder's and the decoder's first layer
    monkeypatch.setattr(graph_self_attention, "project_rows", lambda proj, x, _: proj(x))
    every_row = outputs_and_gradients()
    torch.testing.assert_close(fast[0], every_row[0])
    for a, b in zip(fast[1], every_row[1], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_is_causal(tmp_path, arch):
    task, model = build(tmp_path, arch)
    src = random_tokens(task, [8], 0, left_pad=True)
    prev = random_tokens(task, [13], 1, left_pad=False)
    logits, _ = model(src, torch.tensor([8]), prev)
    for t in [0, 3, 7, 11]:
        changed = prev.clone()
        d = task.target_dictionary
        changed[0, t + 1:] = (prev[0, t + 1:] - d.nspecial + 1) % (len(d) - d.nspecial) + d.nspecial
        other, _ = model(src, torch.tensor([8]), changed)
        torch.testing.assert_close(other[:, :t + 1], logits[:, :t + 1])
        assert not torch.allclose(other[:, t + 1:], logits[:, t + 1:])


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decoding_equals_full_sequence(tmp_path, arch):
    task, model = build(tmp_path, arch, k2(arch))
    src = random_tokens(task, [10, 6], 0, left_pad=True)
    prev = random_tokens(task, [17, 17], 1, left_pad=False)
    encoder_out = model.encoder(src, src_lengths=torch.tensor([10, 6]))
    full, _ = model.decoder(prev, encoder_out=encoder_out)
    state = {}
    for t in range(prev.size(1)):
        if t == 9:  # beam search reorders the cache: swap, then swap back
            order = torch.tensor([1, 0])
            model.decoder.reorder_incremental_state_scripting(state, order)
            model.decoder.reorder_incremental_state_scripting(state, order)
        step, _ = model.decoder(prev[:, :t + 1], encoder_out=encoder_out, incremental_state=state)
        torch.testing.assert_close(step[:, 0], full[:, t])


def test_reorder_encoder_out(tmp_path):
    task, model = build(tmp_path, "bpt_transformer")
    src = random_tokens(task, [5, 3], 0, left_pad=True)
    out = model.encoder(src, src_lengths=torch.tensor([5, 3]))
    reordered = model.encoder.reorder_encoder_out(out, torch.tensor([1, 1, 0]))
    assert reordered["encoder_out"][0].shape == (5, 3, 32)
    torch.testing.assert_close(reordered["encoder_out"][0][:, 2], out["encoder_out"][0][:, 0])
    assert reordered["encoder_padding_mask"][0][:, -2:].tolist() == [[True, True]] * 2 + [[False, False]]


def test_graph_on_one_side_only(tmp_path):
    from fairseq.models.transformer import TransformerDecoderBase
    from fairseq_plugins.modules.bpt.graph_transformer import GraphTransformerDecoder
    _, model = build(tmp_path, "bpt_transformer", ["--graph-sides", "encoder"])
    assert not isinstance(model.decoder, GraphTransformerDecoder)
    assert isinstance(model.decoder, TransformerDecoderBase)


def test_bad_input_raises(tmp_path):
    task, model = build(tmp_path, "bpt_transformer")
    src = torch.full((1, 3), task.source_dictionary.pad())
    with pytest.raises(ValueError, match="empty source"):
        model.encoder(src, src_lengths=torch.tensor([0]))
    too_long = random_tokens(task, [65], 0, left_pad=True)
    with pytest.raises(ValueError, match="max-source-positions"):
        model.encoder(too_long, src_lengths=torch.tensor([65]))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_train_generate_interactive(tiny_data_bin, tmp_path, arch):
    result = train_and_translate(tiny_data_bin, tmp_path / "ckpt", arch,
                                 [*TINY_MODEL_ARGS, *k2(arch)], max_update=20)
    assert "H-0" in result["generate_out"]
    assert result["bleu"] >= 0.0
    assert "H-0" in result["interactive_out"] and "H-1" in result["interactive_out"]


def _relative_position_parameters(model):
    return sum(p.numel() for name, p in model.named_parameters() if name.endswith("rel_key"))


def test_graph_k_past_the_longest_sequence_is_refused_with_the_bound_and_its_cost(tmp_path):
    """k >= the longest sequence - 1 is dense attention; more only grows the relative-position table."""
    positions = ["--max-target-positions", "64"]
    at_bound = _relative_position_parameters(build(tmp_path, "bpt_transformer", ["--graph-k", "63", *positions])[1])
    at_4 = _relative_position_parameters(build(tmp_path, "bpt_transformer", ["--graph-k", "4", *positions])[1])
    with pytest.raises(ValueError) as err:
        build(tmp_path, "bpt_transformer", ["--graph-k", "5000", *positions])
    message = str(err.value)
    assert "--graph-k 5000 is beyond what can help: at k = 63" in message and "dense attention" in message
    assert f"({at_bound:,} at k 63, {at_4:,} at the paper's k 4)" in message  # the real models' tables
    assert "1,920,576 parameters here" in message  # (1 + 2 * 5001 * 3 + 2) types x 16 per head x 4 layers


@pytest.mark.parametrize("cross_from", ["tokens", "nodes"])
def test_decoder_layer_cross_attention_rows_match_a_reference(tmp_path, cross_from):
    """The decoder layer's encoder attention from the first ``num_tokens`` nodes (span nodes pass it
    unchanged), against the layer's sublayers composed by hand: outputs and every gradient
    bitwise equal in float64."""
    from fairseq_plugins.graphs.binary_partition import node_present

    task, model = build(tmp_path, "bpt_transformer", ["--graph-cross-attention", cross_from])
    layer, spec = model.decoder.layers[0], model.decoder._spec
    length, bsz, dim = 5, 3, layer.embed_dim
    graph = spec.build(length)
    absent = ~node_present(torch.tensor([5, 2, 4]), length)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(graph.num_nodes, bsz, dim, generator=gen, dtype=torch.float64)
    enc = torch.randn(4, bsz, dim, generator=gen, dtype=torch.float64)
    enc_mask = torch.tensor([[False] * 4, [False, False, True, True], [False] * 4])
    grad = torch.randn(graph.num_nodes, bsz, dim, generator=gen, dtype=torch.float64)

    def reference(x, enc):
        h = layer.self_attn(x, graph, absent)
        x = layer.self_attn_layer_norm(x + h)  # post-norm, dropout 0
        rows = length if cross_from == "tokens" else x.size(0)
        c, _ = layer.encoder_attn(query=x[:rows], key=enc, value=enc, key_padding_mask=enc_mask, static_kv=True,
                                  need_weights=False)
        x = torch.cat([layer.encoder_attn_layer_norm(x[:rows] + c), x[rows:]])
        return layer.final_layer_norm(x + layer.fc2(layer.activation_fn(layer.fc1(x))))

    grads = []
    for forward in (lambda x, enc: layer(x, enc, enc_mask, graph=graph, self_attn_padding_mask=absent,
                                         num_tokens=length)[0], reference):
        layer.zero_grad()
        xs, encs = x.clone().requires_grad_(), enc.clone().requires_grad_()
        out = forward(xs, encs)
        out.backward(grad)
        grads.append([out.detach(), xs.grad, encs.grad] + [p.grad.clone() for p in layer.parameters()])
    for ours, theirs in zip(*grads):
        assert torch.equal(ours, theirs)
