"""The language models through the real console scripts on the enwik8 fixture: prepare-data,
fairseq-train, fairseq-eval-lm (non-overlapping and sliding window, as fairseq-plugins-evaluate
runs it) and sampling with fairseq-generate."""

import json
import re

import pytest

from fairseq_plugins.recipes import evaluate_lm
from fairseq_plugins.recipes.evaluate import evaluate
from tests.cli import USER_DIR, run_cli
from tests.lm_fixture import ARCHS, HELDOUT


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_train_eval_lm_sample(enwik8_bin, tiny_lm, tmp_path, arch):
    checkpoint = tiny_lm(arch) / "checkpoint_last.pt"
    assert checkpoint.exists()

    def eval_lm(*extra):
        proc = run_cli("fairseq-eval-lm", enwik8_bin, "--user-dir", USER_DIR, "--path", checkpoint,
                       "--gen-subset", "test", "--tokens-per-sample", "64", "--max-tokens", "512", "--cpu", *extra)
        return evaluate_lm.parse(proc.stdout + proc.stderr)

    blocks, sliding = eval_lm(), eval_lm("--context-window", "48")
    # every byte is one token, newlines included; the corpus's end one </s>
    assert blocks["tokens"] == sliding["tokens"] == HELDOUT + 1
    assert 0 < blocks["loss_base2"] < 8 and 0 < sliding["loss_base2"] < 8  # 8 bits: uniform over bytes

    if arch == "bpt_lm":  # what fairseq-plugins-evaluate does with a config's evaluate: section
        cfg = {"name": "lm/tiny_bpt_lm", "table": "t", "id": "tiny", "row": "r", "column": "c", "data": "enwik8",
               "arch": "bpt_lm", "task": {"task": "language_modeling"},
               "evaluate": {"tokens-per-sample": 64, "context-window": 48, "max-tokens": 512}}
        result = evaluate(cfg, enwik8_bin, [checkpoint], "test", tmp_path / "results")
        saved = json.loads((tmp_path / "results" / "lm" / "tiny_bpt_lm.json").read_text())
        assert saved["bpc"] == result["bpc"] == pytest.approx(sliding["loss_base2"])
        assert "48 tokens of context" in saved["bpc_signature"] and saved["tokens"] == HELDOUT + 1

    out = run_cli("fairseq-generate", enwik8_bin, "--user-dir", USER_DIR, "--task", "language_modeling",
                  "--path", checkpoint, "--gen-subset", "test", "--tokens-per-sample", "16", "--sampling",
                  "--beam", "1", "--max-len-b", "40", "--batch-size", "8", "--cpu", "--seed", "1").stdout
    hypotheses = re.findall(r"^H-\d+\t\S+\t(.*)$", out, re.M)
    assert len(hypotheses) == -(-(HELDOUT + 1) // 16)  # one per 16-token block of the test split, as the prompt
    assert any(len(h.split()) > 16 for h in hypotheses)  # the prompt and sampled bytes after it
