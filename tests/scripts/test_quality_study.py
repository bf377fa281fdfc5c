"""scripts/quality_study.py: log parsing, the seed statistics, and the tiny mode end to end
(real fairseq-train / fairseq-generate / sacrebleu on a 300-pair Multi30K subset)."""

import json

import pytest

from fairseq_plugins.recipes.config import CONFIG_DIR
from scripts import quality_study
from tests.cli import MULTI30K

HEAD = "2026-01-01 | INFO | fairseq_cli.train | num. shared model params: 12,345 (num. trained: 12,345)\n"


def _session(start_line: str, inner: str) -> str:
    return f"x | INFO | fairseq_cli.train | {{'_name': None}}\n{start_line}{inner}"


def test_parse_train_log_skips_each_sessions_first_interval_and_reads_valid_loss():
    first = ("| INFO | train_inner | epoch 001:  2 / 9 loss=9, num_updates=2, lr=1, train_wall=50, wall=60\n"
             "| INFO | train_inner | epoch 001:  4 / 9 loss=8, num_updates=4, lr=1, train_wall=2, wall=62\n"
             "| INFO | valid | epoch 001 | valid on 'valid' subset | loss 7.5 | nll_loss 7 | num_updates 4\n")
    second = ("| INFO | train_inner | epoch 001:  6 / 9 loss=7, num_updates=6, lr=1, train_wall=40, wall=45\n"
              "| INFO | train_inner | epoch 001:  8 / 9 loss=6, num_updates=8, lr=1, train_wall=6, wall=51\n"
              "| INFO | valid | epoch 001 | valid on 'valid' subset | loss 6.25 | nll_loss 6 | num_updates 8\n")
    log = _session(HEAD, first) + _session(HEAD, second)
    assert quality_study.parse_train_log(log, 4) == {"params": 12345, "seconds_per_update": 1.0, "valid_loss": 7.5}
    # the start-up intervals (50 s, 40 s) are left out: (2 + 6) s over 4 updates
    assert quality_study.parse_train_log(log, 8) == {"params": 12345, "seconds_per_update": 2.0, "valid_loss": 6.25}
    with pytest.raises(ValueError, match="params"):
        quality_study.parse_train_log(first, 4)


def _result(key, seed, bleu, seconds):
    return {"key": key, "name": key, "group": "g", "arch": "a", "seed": seed, "updates": 10, "params": 1,
            "seconds_per_update": seconds, "valid_loss": 5.0, "sacrebleu": bleu, "sacrebleu_signature": "s"}


def test_summary_statistics_and_time_ratio_by_seed():
    results = [_result("base", 1, 10.0, 1.0), _result("base", 2, 12.0, 2.0), _result("base", 3, 14.0, 1.0),
               _result("m", 1, 11.0, 1.5), _result("m", 2, 11.0, 2.0), _result("m", 3, 11.0, 3.0)]
    rows = {r["key"]: r for r in quality_study.summarize(results, "base")}
    assert rows["base"]["sacrebleu"] == {"mean": 12.0, "std": 2.0, "min": 10.0, "max": 14.0, "n": 3}
    assert rows["m"]["time_ratio"] == 1.5 and rows["m"]["time_ratio_range"] == (1.0, 3.0)
    diff = quality_study.difference(list(rows.values()), "m", "base", 10)
    assert diff["diff"] == pytest.approx(-1.0) and diff["se"] == pytest.approx((4 / 3) ** 0.5)
    loss = quality_study.difference(list(rows.values()), "m", "base", 10, "valid_loss")
    assert loss == {"diff": 0.0, "se": 0.0}
    table = quality_study.markdown(list(rows.values()), {"baseline": "base", "comparisons": [
        {"key": "m", "reference": "base", "isolates": "the change"},
        {"key": "m", "reference": "absent", "isolates": "nothing"}]})
    assert "| m | 10 | 11.00 ± 0.00 | [1, 2, 3]: 11.00, 11.00, 11.00 |" in table
    assert "| m - base | the change | 10 | -1.00 ± 1.15 | +0.000 ± 0.000 |" in table
    assert "absent" not in table  # a comparison with a row that did not run is left out


def test_record_adds_a_run_with_rows_and_comparisons_and_replaces_one_of_the_same_label(tmp_path):
    results = [_result("base", 1, 10.0, 1.0), _result("base", 2, 12.0, 2.0),
               _result("m", 1, 11.0, 1.5), _result("m", 2, 15.0, 2.0)]
    rows = quality_study.summarize(results, "base")
    cfg = {"comparisons": [{"key": "m", "reference": "base", "isolates": "the change"}]}
    path = tmp_path / "quality_study.json"
    quality_study.record(path, "machine A", "2 cores", rows, cfg, "python -m scripts.quality_study")
    quality_study.record(path, "machine B", "4 cores", rows[:1], cfg, "python -m scripts.quality_study --models base")
    runs = json.loads(path.read_text())["runs"]
    assert [r["label"] for r in runs] == ["machine A", "machine B"]
    assert runs[0]["rows"] == json.loads(json.dumps(rows)) and runs[1]["comparisons"] == []
    (comparison,) = runs[0]["comparisons"]
    assert (comparison["key"], comparison["reference"], comparison["updates"]) == ("m", "base", 10)
    assert comparison["sacrebleu"]["diff"] == pytest.approx(2.0)
    quality_study.record(path, "machine A", "2 cores", rows[1:], cfg, "again")
    runs = json.loads(path.read_text())["runs"]
    assert [r["label"] for r in runs] == ["machine B", "machine A"] and runs[1]["commands"] == ["again"]


def test_the_study_config_is_valid_and_refuses_unknown_baselines(tmp_path):
    cfg = quality_study.load_study(CONFIG_DIR / "quality_study.yaml")
    assert cfg["baseline"] == "transformer_postnorm" and len(cfg["seeds"]) >= 3
    keys = {m["key"] for m in cfg["models"]}
    assert all({c["key"], c["reference"]} <= keys for c in cfg["comparisons"])
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIG_DIR / "quality_study.yaml").read_text().replace(
        "baseline: transformer_postnorm", "baseline: nothing"))
    with pytest.raises(ValueError, match="baseline"):
        quality_study.load_study(bad)
    bad.write_text((CONFIG_DIR / "quality_study.yaml").read_text().replace(
        "reference: transformer_prenorm", "reference: transformer_nonorm"))
    with pytest.raises(ValueError, match="comparison"):
        quality_study.load_study(bad)


@pytest.mark.slow
@pytest.mark.cli
def test_tiny_study_trains_resumes_scores_and_reports(tmp_path):
    argv = ["--tiny", "--models", "transformer_postnorm,slowfast_slow_only", "--seeds", "1", "--out", str(tmp_path),
            "--raw-dir", str(MULTI30K)]
    rows = quality_study.main(argv)
    assert {(r["key"], r["updates"]) for r in rows} == {
        (k, u) for k in ("transformer_postnorm", "slowfast_slow_only") for u in (2, 4)}
    for r in rows:
        assert r["seeds"] == [1] and r["sacrebleu"]["n"] == 1 and r["params"] > 0
    run = tmp_path / "runs" / "slowfast_slow_only" / "seed1"
    assert (run / "checkpoint_2.pt").exists() and (run / "checkpoint_4.pt").exists()
    log = (run / "train.log").read_text()
    resumed = log.split("Loaded checkpoint")[1]
    assert log.count("fairseq_cli.train | {") == 2 and "(epoch 1 @ 2 updates)" in resumed
    assert (tmp_path / "quality_study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "quality_study.json").read_text())
    assert len(saved["runs"]) == 4
    # a second call finds every result and trains nothing; --record adds them to a committed file
    record = ["--record", str(tmp_path / "recorded.json"), "--label", "tiny", "--machine", "this machine"]
    assert quality_study.main(argv + record) == json.loads(json.dumps(rows))
    assert (run / "train.log").read_text() == log
    (recorded,) = json.loads((tmp_path / "recorded.json").read_text())["runs"]
    assert recorded["label"] == "tiny" and recorded["rows"] == json.loads(json.dumps(rows))
    assert recorded["commands"] == [" ".join(["python -m scripts.quality_study", *argv, *record])]
