"""fairseq-train under bad options and bad data: refused in one line before the first update,
nothing saved."""

import pytest

from tests.bad_input import refusal
from tests.cli import USER_DIR
from tests.lm_fixture import ARCHS, TINY


def _train_lm(data, save, *extra):
    return ["fairseq-train", data, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "bpt_lm", *TINY,
            *ARCHS["bpt_lm"], "--max-tokens", "512", "--optimizer", "adam", "--lr", "0.003", "--max-update", "2",
            "--save-dir", save, "--cpu", "--num-workers", "0", *extra]


@pytest.mark.slow
def test_an_lm_graph_k_is_bounded_by_its_tokens_per_sample(enwik8_bin, tmp_path):
    line = refusal(*_train_lm(enwik8_bin, tmp_path / "ckpt", "--graph-k", "100"))
    assert line.startswith("ValueError: --graph-k 100 is beyond what can help: at k = 63 (the longest sequence, "
                           "--tokens-per-sample 64, minus one)") and line.endswith("Use --graph-k <= 63"), line
    assert not list((tmp_path / "ckpt").glob("*.pt"))  # fairseq-train makes the folder first, empty
