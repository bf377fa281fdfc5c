"""transformer_slowfast end to end through the real fairseq console scripts: the
characters come from src_tokens inside the model, so generate/interactive need no extra
input files."""

import pytest
import sentencepiece

from tests.cli import generate, hypotheses, interactive, train, train_and_translate

pytestmark = pytest.mark.slow

SLOWFAST_TINY = ["--fast-embed-dim", "16", "--fast-attention-heads", "2", "--dropout", "0.1"]


def test_train_generate_interactive(tiny_data_bin, tmp_path):
    result = train_and_translate(tiny_data_bin, tmp_path / "ckpt", "transformer_slowfast", SLOWFAST_TINY, max_update=30)
    assert "model: TransformerSlowFastModel" in result["train_log"]
    assert len(hypotheses(result["generate_out"])) == 40  # every test sentence translated
    assert result["bleu"] >= 0.0
    assert len(hypotheses(result["interactive_out"])) == 2


def test_ablation_options_survive_the_checkpoint(tiny_data_bin, tmp_path):
    extra = SLOWFAST_TINY + [
        "--slowfast-fusion", "downsample-concat", "--slowfast-encoder-output", "both",
        "--slowfast-interaction-layers", "last", "--no-boundary-pe",
    ]  # fmt: skip
    result = train_and_translate(tiny_data_bin, tmp_path / "ckpt", "transformer_slowfast", extra, max_update=10)
    assert "slowfast_fusion='downsample-concat'" in result["train_log"]
    assert len(hypotheses(result["generate_out"])) == 40
    assert len(hypotheses(result["interactive_out"])) == 2


def test_linear_fast_attention(tiny_data_bin, tmp_path):
    extra = SLOWFAST_TINY + ["--fast-self-attention", "linear", "--fast-linear-attention-length", "16"]
    result = train_and_translate(tiny_data_bin, tmp_path / "ckpt", "transformer_slowfast", extra, max_update=10)
    assert "fast_self_attention='linear'" in result["train_log"]
    assert len(hypotheses(result["generate_out"])) == 40
    assert len(hypotheses(result["interactive_out"])) == 2


def test_sentencepiece_fast_input_translates_without_its_model_file(tiny_data_bin, tmp_path):
    """The checkpoint carries the sentencepiece model: generate and interactive work
    after the .model file is gone."""
    raw = tiny_data_bin.parent / "raw"
    prefix = tmp_path / "fast_spm"
    sentencepiece.SentencePieceTrainer.train(
        input=str(raw / "train.en"), model_prefix=str(prefix), vocab_size=200, hard_vocab_limit=False, minloglevel=3
    )
    model = prefix.with_suffix(".model")
    extra = SLOWFAST_TINY + ["--fast-input", "sentencepiece", "--fast-sentencepiece-model", model]
    log = train(tiny_data_bin, tmp_path / "ckpt", "transformer_slowfast", extra, max_update=10).stdout
    assert "fast_input='sentencepiece'" in log
    model.unlink()
    checkpoint = tmp_path / "ckpt" / "checkpoint_last.pt"
    assert len(hypotheses(generate(tiny_data_bin, checkpoint))) == 40
    lines = (raw / "test.en").read_text(encoding="utf-8").splitlines()[:2]
    assert len(hypotheses(interactive(tiny_data_bin, checkpoint, lines))) == 2
