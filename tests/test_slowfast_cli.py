"""transformer_slowfast end to end through the real fairseq console scripts: the
characters come from src_tokens inside the model, so generate/interactive need no extra
input files."""

from tests.cli import hypotheses, train_and_translate

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
