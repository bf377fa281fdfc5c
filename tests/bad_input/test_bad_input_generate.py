"""fairseq-generate under bad input: a checkpoint of another kind is named as such."""

import pytest

from tests.bad_input import refusal
from tests.cli import USER_DIR


@pytest.mark.slow
def test_a_language_model_checkpoint_is_refused_by_generate(tiny_data_bin, tiny_lm):
    line = refusal("fairseq-generate", tiny_data_bin, "--user-dir", USER_DIR, "--path",
                   tiny_lm("bpt_lm") / "checkpoint_last.pt", "--gen-subset", "test", "--cpu")
    assert line == ("ValueError: bpt_lm is a language model, not a translation model: give fairseq-generate or "
                    "fairseq-interactive --task language_modeling, or score it with fairseq-eval-lm")
