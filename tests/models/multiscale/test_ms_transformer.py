"""The registered ms_transformer model: construction from command-line options, fairseq
integration (padding, incremental decoding, checkpoints) and the real console scripts."""

import pytest
import torch

from fairseq import options, tasks
from fairseq_plugins.models import ms_transformer  # noqa: F401  (registers the model in-process)
from fairseq_plugins.modules.multiscale.multiscale_attention import MultiScaleSelfAttention
from tests.cli import TINY_MODEL_ARGS, hypotheses, train_and_translate


def _build(data_bin, *extra):
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, [str(data_bin), "--arch", "ms_transformer", *TINY_MODEL_ARGS,
                 "--dropout", "0", *map(str, extra)],
    )  # fmt: skip
    task = tasks.setup_task(args)
    torch.manual_seed(0)
    return task, task.build_model(args).double().eval()


def _scales(layer):
    return [str(scale) for scale in layer.self_attn.scales]


def test_options_reach_the_layers(tiny_data_bin):
    task, model = _build(
        tiny_data_bin, "--encoder-attention-heads", "4", "--encoder-layers", "3",
        "--encoder-scales", "1,3,N/4,all|3,3,5,5|N/2,N/2,all,all",
        "--encoder-drop-ffn", "--encoder-no-positions",
        "--decoder-self-attention", "multiscale", "--decoder-scale-alpha", "1.0",
    )  # fmt: skip
    enc, dec = model.encoder, model.decoder
    assert [_scales(layer) for layer in enc.layers] == [
        ["1", "3", "N/4", "all"], ["3", "3", "5", "5"], ["N/2", "N/2", "all", "all"]
    ]
    assert enc.embed_positions is None and dec.embed_positions is not None
    assert not any(hasattr(layer, "fc1") for layer in enc.layers)
    # alpha 1.0, 2 heads over 1,3,N/16,N/8,N/4: bottom shares .64,.23,.09,.03,.01 -> both
    # heads local; top uniform: cumulative 0.4, 0.8, 1.2, ... heads -> ceil 1,1,2 -> 1 and N/16
    assert [_scales(layer) for layer in dec.layers] == [["1", "1"], ["1", "N/16"]]
    assert all(isinstance(layer.self_attn, MultiScaleSelfAttention) and layer.self_attn.causal for layer in dec.layers)


def test_defaults_are_an_alpha_encoder_and_a_standard_decoder(tiny_data_bin):
    _, model = _build(tiny_data_bin)
    assert [_scales(layer) for layer in model.encoder.layers] == [["1", "3"], ["1", "N/16"]]
    assert all(hasattr(layer, "fc1") for layer in model.encoder.layers)
    assert all(type(layer.self_attn).__name__ == "MultiheadAttention" for layer in model.decoder.layers)


def test_bad_scale_options_fail_at_build_time(tiny_data_bin):
    with pytest.raises(ValueError, match="3 scales for 2 heads"):
        _build(tiny_data_bin, "--encoder-scales", "1,3,5")
    with pytest.raises(ValueError, match="odd"):
        _build(tiny_data_bin, "--decoder-self-attention", "multiscale", "--decoder-scales", "2,4")


def _batch(task, n=3):
    dataset = task.load_dataset("valid") or task.dataset("valid")
    return dataset.collater([dataset[i] for i in range(n)])


@pytest.mark.parametrize("drop_ffn", [[], ["--encoder-drop-ffn", "--encoder-no-positions"]])
def test_padding_in_a_batch_never_changes_the_encoder_output(tiny_data_bin, drop_ffn):
    task, model = _build(tiny_data_bin, "--encoder-scales", "N/4,3", *drop_ffn)
    net_input = _batch(task)["net_input"]
    tokens, lengths = net_input["src_tokens"], net_input["src_lengths"]
    assert lengths.min() < lengths.max(), "the batch needs padding to test anything"
    batched = model.encoder(tokens, lengths)["encoder_out"][0]
    for row, n in enumerate(lengths.tolist()):
        alone = model.encoder(tokens[row : row + 1, -n:], lengths[row : row + 1])["encoder_out"][0]
        torch.testing.assert_close(batched[-n:, row], alone[:, 0])


def test_incremental_decoding_equals_the_teacher_forced_pass(tiny_data_bin):
    task, model = _build(tiny_data_bin, "--decoder-self-attention", "multiscale",
                         "--decoder-scales", "3,N/2|all,1")  # fmt: skip
    sample = _batch(task)
    enc = model.encoder(**{k: sample["net_input"][k] for k in ("src_tokens", "src_lengths")})
    prev = sample["net_input"]["prev_output_tokens"]
    full, _ = model.decoder(prev, encoder_out=enc)
    state = {}
    for t in range(prev.shape[1]):
        step, _ = model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)
        real = prev[:, t].ne(task.target_dictionary.pad())
        torch.testing.assert_close(step[real, 0], full[real, t])


@pytest.mark.slow
def test_train_generate_interactive_end_to_end(tiny_data_bin, tmp_path):
    """Paper options (no FFN, no encoder positions) plus a causal multi-scale decoder."""
    result = train_and_translate(
        tiny_data_bin, tmp_path / "ckpt", "ms_transformer", max_update=20,
        extra_train_args=["--encoder-drop-ffn", "--encoder-no-positions", "--encoder-scales", "3,N/4|1,all",
                          "--decoder-self-attention", "multiscale"],
    )  # fmt: skip
    assert "num_updates 20" in result["train_log"] or "done training" in result["train_log"]
    assert len(hypotheses(result["generate_out"])) > 0
    assert result["bleu"] >= 0.0
    assert len(hypotheses(result["interactive_out"])) == 2
