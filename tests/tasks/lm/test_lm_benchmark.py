"""scripts/benchmark_lm.py runs end to end in a tiny mode and writes its results (numbers unchecked)."""

import json

import pytest

from tests.scripts.test_scripts_benchmarks import run_script

pytestmark = pytest.mark.cli  # every test here runs a program of scripts/


@pytest.mark.slow
def test_benchmark_lm_tiny(tmp_path):
    out = tmp_path / "lm"
    proc = run_script("benchmark_lm", "--contexts", "32", "64", "--ks", "2", "--checkpointed-ks", "2",
                      "--recomputed-ks", "2",
                      "--layers", "1", "--dim", "16", "--heads", "2", "--tokens", "128", "--rounds", "1",
                      "--threads", "1", "--prefixes", "8", "16", "--sample-steps", "2", "--backend", "torch",
                      "--out", out)  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["train"]) == {"transformer_lm", "bpt_lm k2", "bpt_lm k2 checkpointed",
                                    "bpt_lm k2 recompute-norms-ffn", "bpt_lm k2 checkpointed + recompute-norms-ffn"}
    assert set(result["train"]["bpt_lm k2"]) == {"32", "64"} and result["train"]["bpt_lm k2"]["64"]["peak_mb"] >= 0
    assert set(result["sampling"]) == {"transformer_lm", "bpt_lm k2"}  # recomputation is training only
    assert set(result["sampling"]["bpt_lm k2"]) == {"8", "16"}
    assert "| bpt_lm k2 | 64 |" in proc.stdout and out.with_suffix(".md").exists()
