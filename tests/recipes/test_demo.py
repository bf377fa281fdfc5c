"""The demo's pieces that need no fairseq run: the speed measurement, the progress display,
the table's relative speed column, the busy-machine warnings and the config checks.
The demo itself runs end to end in tests/recipes/test_scripts_pipeline.py."""

import io

import pytest
import yaml

from fairseq_plugins.recipes import demo
from fairseq_plugins.recipes.demo_progress import DemoProgress, clock
from tests.cli import REPO

DEMO_YAML = REPO / "configs" / "demo.yaml"


def _inner(updates: int) -> str:
    return f"| INFO | train_inner | epoch 001:  {updates} / 9 loss=9.1, wps=100, ups=1, num_updates={updates}\n"


def test_update_timer_takes_the_median_of_uninterrupted_intervals():
    timer = demo.UpdateTimer()
    lines = [(0.0, _inner(10)), (2.0, _inner(20)), (4.0, _inner(30)), (14.0, _inner(40)),  # 0.2, 0.2, 1.0
             (15.0, "| INFO | valid | epoch 001 | valid on 'valid' subset | loss 9 | num_updates 45\n"),
             (16.0, "| INFO | train | epoch 001 | loss 9.0 | wps 250.0 | ups 2 | num_updates 45 | wall 3\n"),
             (30.0, _inner(50)),  # spans validation and the epoch's end: not an update time
             (32.0, _inner(60))]  # 0.2
    done = [timer.line(text, t) for t, text in lines]
    assert done == [10, 20, 30, 40, None, 45, 50, 60]
    assert timer.intervals == pytest.approx([0.2, 0.2, 1.0, 0.2])
    assert timer.seconds_per_update() == pytest.approx(0.2)  # the slowed interval does not count
    assert demo.UpdateTimer().seconds_per_update() is None


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_writes_lines_with_stage_updates_and_eta_when_not_a_tty():
    clock_, stream = FakeClock(), io.StringIO()
    p = DemoProgress(["A", "B"], updates=100, stream=stream, interval=10.0, now=clock_)
    assert p.bar is None  # a StringIO is not a terminal
    p.set_stage(0, "starting")
    clock_.t = 5.0
    p.trained(0, 10, None)  # the first progress: training
    clock_.t = 6.0
    p.trained(0, 20, 0.5)  # within the interval: no line
    clock_.t = 16.0
    p.trained(0, 40, 0.5)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 3
    assert lines[0] == "[demo] 1/2 A: starting 0/100 updates; ETA ? (all models 0/200 updates)"
    # 60 updates of A and 100 of B at 0.5 s, nothing known yet about translation: a lower bound
    assert lines[2] == "[demo] 1/2 A: training 40/100 updates; ETA >1:20 (all models 40/200 updates)"
    p.trained(0, 100, 0.5)
    p.set_stage(0, "translating")
    clock_.t = 70.0
    p.finished(0)  # 70 s spent, 50 s of them in updates: 20 s of start-up and translation per model
    assert stream.getvalue().splitlines()[-1] == \
        "[demo] 1/2 A: done 100/100 updates; ETA 1:10 (all models 100/200 updates)"
    p.write("a message")
    assert stream.getvalue().endswith("a message\n")


def test_progress_with_a_time_budget_counts_down_to_the_deadline():
    clock_ = FakeClock()
    p = DemoProgress(["A"], updates=None, deadline=600.0, stream=io.StringIO(), now=clock_)
    clock_.t = 100.0
    assert p.eta() == (500.0, False)
    assert p.status() == "1/1 A: waiting 0 updates; ETA 8:20"


def test_progress_on_a_terminal_is_one_bar_over_all_updates():
    stream = io.StringIO()
    p = DemoProgress(["A", "B"], updates=50, stream=stream, tty=True, now=FakeClock())
    p.set_stage(1, "training")
    p.trained(1, 30, 0.1)
    assert p.bar.total == 100 and p.bar.n == 30
    p.close()
    assert "2/2 B: training" in stream.getvalue() and "30/100 updates" in stream.getvalue()
    with pytest.raises(ValueError, match="unknown stage"):
        p.set_stage(0, "sleeping")


def test_clock():
    assert [clock(s) for s in (0, 59.6, 1234, 4000)] == ["0:00", "1:00", "20:34", "1:06:40"]


def _row(name, spu, bleu=20.0):
    return {"name": name, "arch": name.lower(), "sacrebleu": bleu, "tokenized": bleu, "params": 1000,
            "updates": 400, "words_per_second": 5000.0, "seconds_per_update": spu,
            "sacrebleu_signature": "nrefs:1"}


RUN = {"updates": 400, "minutes": None, "seed": 1, "baseline": "Transformer", "device": "CPU (2 cores)",
       "cores": 2, "threads": 2, "models": 3, "load": {"mean": 6.0, "max": 9.0}, "seconds": 1800.0}


def test_relative_time_column_is_against_the_baseline_of_the_same_run(tmp_path):
    rows = [_row("Transformer", 0.25), _row("BPT", 0.375), _row("Slow", None)]
    demo.relative_times(rows, "Transformer")
    assert [r["relative_time"] for r in rows] == [1.0, 1.5, None]
    table = demo.markdown(rows, RUN)
    assert "| time/update vs Transformer |" in table.splitlines()[5]
    assert "| 5000 | 1.00x |" in table and "| 5000 | 1.50x |" in table and "| 5000 | – |" in table
    assert "400 updates per model (seed 1) on CPU (2 cores)" in table
    assert "busy machine, so the speed columns are noisy" in table and "took 30:00" in table
    assert "2 of 3 models done after 30:00" in demo.markdown(rows[:2], RUN)  # an interrupted demo
    quiet = demo.markdown(rows, {**RUN, "load": {"mean": 2.1, "max": 2.4}})
    assert "noisy" not in quiet
    demo.plot(rows, "Transformer", tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    without = [_row("BPT", 0.375)]
    demo.relative_times(without, "Transformer")  # the baseline was not run: no ratio
    assert without[0]["relative_time"] is None


def test_busy_warnings():
    assert demo.busy_warnings(load=1.5, cores=2, threads=2) == []
    busy = demo.busy_warnings(load=9.3, cores=2, threads=2)
    assert len(busy) == 1 and "load average 9.3 on 2 cores" in busy[0] and "BLEU does not change" in busy[0]
    over = demo.busy_warnings(load=0.1, cores=2, threads=8)
    assert len(over) == 1 and "--threads 2" in over[0]


def test_demo_config_is_checked(tmp_path):
    cfg = demo.load_demo_config(DEMO_YAML)
    assert cfg["updates"] > 0 and cfg["baseline"] in [e["name"] for e in cfg["architectures"]]
    raw = yaml.safe_load(DEMO_YAML.read_text())
    for change, message in [({"train": {**raw["train"], "max-update": 5}}, "set by the demo"),
                            ({"baseline": "Nope"}, "baseline 'Nope'"),
                            ({"updates": 0}, "positive integer")]:
        path = tmp_path / "demo.yaml"
        path.write_text(yaml.dump({**raw, **change}))
        with pytest.raises(ValueError, match=message):
            demo.load_demo_config(path)


def test_usable_cores_sees_a_container_quota(tmp_path):
    assert demo.cgroup_cpu_quota(tmp_path) is None  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert demo.cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # docker --cpus 1.5
    assert demo.cgroup_cpu_quota(tmp_path) == 1.5
    assert demo.usable_cores(tmp_path) == min(2, demo.usable_cores(tmp_path / "none"))
    (tmp_path / "cpu.max").unlink()
    v1 = tmp_path / "cpu"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert demo.cgroup_cpu_quota(tmp_path) is None
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    assert demo.cgroup_cpu_quota(tmp_path) == 1.0 and demo.usable_cores(tmp_path) == 1


def test_train_command_stops_at_the_fixed_updates_or_the_time_share(tmp_path):
    cfg = demo.load_demo_config(DEMO_YAML)
    entry = cfg["architectures"][0]

    def command(updates, seconds):
        cmd = demo.train_command(entry, cfg, tmp_path / "data", tmp_path / "run", updates, seconds,
                                 gpu=False, log_interval=10)
        assert cmd[-1] == "--cpu"
        return dict(zip(cmd, cmd[1:]))

    fixed = command(400, None)
    assert fixed["--max-update"] == "400" and "--stop-time-hours" not in fixed
    assert fixed["--seed"] == str(cfg["seed"]) and fixed["--arch"] == entry["arch"]
    both = command(400, 360.0)
    assert both["--max-update"] == "400" and both["--stop-time-hours"] == "0.100000"
    budget_only = command(0, 360.0)
    assert "--max-update" not in budget_only and budget_only["--stop-time-hours"] == "0.100000"


@pytest.mark.slow
@pytest.mark.cli
def test_language_model_part_trains_both_models_in_alternating_rounds(tmp_path):
    """``--lm`` in tiny mode: fairseq-train resumed round by round, fairseq-eval-lm on the test split."""
    import json
    import math

    tiny = ["--context", "64", "--updates", "4", "--rounds", "2", "--max-tokens", "256", "--dim", "16",
            "--heads", "2", "--lr", "0.01", "--warmup", "1", "--log-interval", "1", "--heldout-chars", "2048",
            "--backend", "torch"]
    result = demo.language_model_part(tmp_path / "lm", threads=1, options=tiny)
    assert [r["model"] for r in result["rows"]] == ["transformer_lm", "bpt_lm k4"]
    vocab = len((tmp_path / "lm" / "data-bin" / "dict.txt").read_text().splitlines())
    for row in result["rows"]:
        assert [r["updates_done"] for r in row["rounds"]] == [2, 4]  # the second round resumed the first's
        assert row["test_tokens"] == 2048 + 1  # one token per character of the test split, and the final </s>
        assert 0 < row["bpc"] < math.log2(vocab)  # below the uniform distribution's bits
        assert len(row["speed_vs_baseline_per_round"]) == 2 and row["tokens_per_second"] > 0
    assert result["rows"][0]["speed_vs_baseline_per_round"] == [1.0, 1.0]
    saved = json.loads((tmp_path / "lm" / "lm_study.json").read_text())
    assert saved["corpus"]["symbols"]["test"] == 2048 and len(saved["corpus"]["sha256"]) == 64
    assert "| bpt_lm k4 |" in (tmp_path / "lm" / "lm_study.md").read_text()
