"""fairseq-eval-lm and the language-model evaluation under bad input: a context longer than
trained, a checkpoint of another kind. Never a loss over zero tokens."""

import pytest

from fairseq_plugins.recipes import evaluate_lm
from tests.bad_input import refusal
from tests.cli import USER_DIR, run_cli
from tests.lm_fixture import HELDOUT
from tests.models.test_checkpoint_compat import FIXTURES

LONGER = "256"  # tokens per sample: four times the tiny models' 64


def _eval_lm(data, checkpoint, *extra):
    return ["fairseq-eval-lm", data, "--user-dir", USER_DIR, "--path", checkpoint, "--gen-subset", "test",
            "--max-tokens", "1024", "--cpu", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bpt_lm", "segtree_lm"])
def test_a_graph_lm_scores_every_token_at_a_longer_context(enwik8_bin, tiny_lm, arch):
    """No absolute positions: the model takes the longer blocks instead of skipping them."""
    checkpoint = tiny_lm(arch) / "checkpoint_last.pt"
    proc = run_cli(*_eval_lm(enwik8_bin, checkpoint, "--tokens-per-sample", LONGER))
    scores = evaluate_lm.parse(proc.stdout + proc.stderr)
    assert scores["tokens"] == HELDOUT + 1 and 0 < scores["loss_base2"] < 8  # every byte and the split's </s>


@pytest.mark.slow
def test_a_model_with_positions_refuses_a_longer_context(enwik8_bin, tiny_lm):
    checkpoint = tiny_lm("window_lm") / "checkpoint_last.pt"
    line = refusal(*_eval_lm(enwik8_bin, checkpoint, "--tokens-per-sample", LONGER))
    assert line == ("ValueError: --tokens-per-sample 256 is longer than the 64 positions window_lm was trained "
                    "with (absolute positions): every block would be skipped and nothing scored; use "
                    "--tokens-per-sample <= 64")


SKIPPED = ("2024-01-01 | WARNING | fairseq.data.data_utils | 12 samples have invalid sizes and will be skipped, "
           "max_positions=64, first few sample ids=[0, 1]\n"
           "2024-01-01 | INFO | fairseq_cli.eval_lm | Evaluated 0 tokens in 0.0s (0.00 tokens/s)\n"
           "2024-01-01 | INFO | fairseq_cli.eval_lm | Loss (base 2): 0.0000, Perplexity: 1.00\n")


def test_a_loss_over_skipped_blocks_is_refused_naming_them():
    """fairseq's own transformer_lm is not the plugin's to refuse: its output is."""
    with pytest.raises(ValueError, match=r"^fairseq-eval-lm skipped 12 blocks longer than the model's 64 positions, "
                                         r"so its loss is not the subset's: evaluate with tokens-per-sample <= 64$"):
        evaluate_lm.parse(SKIPPED)


def test_a_loss_over_zero_tokens_is_refused():
    empty = SKIPPED.split("\n", 1)[1]
    with pytest.raises(ValueError, match="^fairseq-eval-lm scored 0 tokens: the subset is empty$"):
        evaluate_lm.parse(empty)


@pytest.mark.slow
def test_a_translation_checkpoint_is_refused_by_eval_lm(enwik8_bin):
    line = refusal(*_eval_lm(enwik8_bin, FIXTURES / "bpt_transformer" / "checkpoint.pt"))
    assert line == ("ValueError: bpt_transformer is a translation model, not a language model: score it with "
                    "fairseq-generate (its translation task), not with fairseq-eval-lm or --task language_modeling")
