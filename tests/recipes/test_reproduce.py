"""fairseq-plugins-reproduce: one command per paper table. Its --dry-run prints every command in
full (training and evaluation) for every table, without fairseq on PATH too; the cluster settings
(options or environment variables) reach the fairseq-train commands; --list and --explain."""

import math
import os
import re
import subprocess
import sys

import pytest

from fairseq_plugins import resources
from fairseq_plugins.recipes import reproduce_table
from fairseq_plugins.recipes.config import load_tables, run_key, seed_configs

TABLES = load_tables()
# the others: test_slowfast_flops, test_figure_tables (the measured figures, and Multi-Scale Figure 3, not built)
TRAINED = sorted(t for t, spec in TABLES.items() if spec["measure"] is None and spec["configs"])


def _dry_run(capsys, table, *options):
    reproduce_table.main([table, "--dry-run", *options])
    return capsys.readouterr().out


@pytest.mark.parametrize("table", TRAINED)
def test_dry_run_prints_every_training_and_evaluation_command_in_full(table, tmp_path, capsys):
    configs = TABLES[table]["configs"]
    out = _dry_run(capsys, table, "--gpus", "2", "--precision", "fp32", "--data-root", str(tmp_path / "data"),
                   "--runs-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results"))
    assert out.startswith(f"{table}: {len(configs)} rows")
    commands = [line for line in out.splitlines() if re.match(r"\s+\S*fairseq-train ", line)]
    runs = {run_key(r): r for c in configs for r in seed_configs(c)}  # one run per seed of the paper's protocol
    assert len(commands) == len(runs)
    for command in commands:
        cfg = runs[re.search(r"--save-dir \S+/runs/(\S+)", command).group(1)]
        paper_freq = int(cfg["train"].get("update-freq", 1))
        if paper_freq * cfg["gpus"] >= 2:
            assert f"--update-freq {max(1, math.ceil(paper_freq * cfg['gpus'] / 2))} " in command + " "
        assert "--distributed-world-size 2" in command and "--fp16" not in command
    lines = out.splitlines()
    for cfg in configs:
        at = next(i for i, line in enumerate(lines) if f"fairseq-plugins-evaluate {table}:{cfg['id']} " in line)
        evaluation = lines[at + 1 + bool(cfg["average_last"])]
        task = cfg["task"].get("task")
        if task == "language_modeling":
            assert re.match(r"\s+\S*fairseq-eval-lm \S+ --path \S+checkpoint_best.pt --user-dir", evaluation)
        elif task in ("sentence_prediction", "sequence_tagging"):
            assert "scored in-process" in evaluation and evaluation.count("checkpoint") == len(seed_configs(cfg))
        else:
            assert re.match(r"\s+\S*fairseq-generate \S+ --path \S+checkpoint_\S+ --gen-subset test", evaluation)
        if cfg["average_last"]:
            assert f"--last {cfg['average_last']} --output" in lines[at + 1]
    assert lines[-1].startswith(f"fairseq-plugins-results-table {table}") or lines[-1].startswith("note: ")


def test_list_shows_the_tables_and_one_tables_rows(capsys):
    reproduce_table.main(["--list"])
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(TABLES)
    assert any(re.match(r"bpt-table7 +5 rows +5 training runs +bpt/table7.yaml", line) for line in listed)
    reproduce_table.main(["bpt-table7", "--list"])
    rows = capsys.readouterr().out
    assert "bpt-table7:bpt-k4" in rows and "BPT (k = 4) | BLEU (paper: sacrebleu 27.6)" in rows


def test_explain_prints_each_value_with_its_source(capsys):
    out = _dry_run(capsys, "bpt-table4", "--explain", "--rows", "enwik8-l512")
    assert re.search(r"model.graph-rel-clip = 2 +original: yzh119/BPT@3ce980d\S* configs/enwik8-512.yml", out)
    assert re.search(r"train.lr = 0.00041 +original: yzh119/BPT@3ce980d\S* configs/enwik8-512.yml", out)
    evaluation = next(line for line in out.splitlines() if "fairseq-eval-lm" in line)
    assert "--tokens-per-sample 1024" in evaluation and "--context-window 512" in evaluation


def _cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "fairseq_plugins.recipes.reproduce_table", *args],
                          capture_output=True, text=True, env={**os.environ, **env})


@pytest.mark.cli
def test_cluster_settings_come_from_the_environment():
    proc = _cli("bpt-table7", "--dry-run", "--rows", "bpt-k4", GPUS="4", UPDATE_FREQ="3", NNODES="2", NODE_RANK="1",
                MASTER_ADDR="10.0.0.1", PRECISION="bf16")
    assert proc.returncode == 0, proc.stderr
    command = next(line for line in proc.stdout.splitlines() if "fairseq-train" in line).split()
    assert command[0].endswith("torchrun") and command[1:6] == [
        "--nproc_per_node=4", "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29500"]
    joined = " ".join(command)
    assert "--update-freq 3 " in joined and "--distributed-world-size 8" in joined and joined.endswith("--bf16")
    assert "fairseq-plugins-evaluate" not in proc.stdout  # node 1 only trains
    cpu = _cli("bpt-table7", "--dry-run", "--gpus", "0")
    assert all("--cpu" in line for line in cpu.stdout.splitlines() if "fairseq-train" in line)
    assert "8 in the paper" in cpu.stdout.splitlines()[0]


@pytest.mark.cli
def test_a_dry_run_needs_no_fairseq_and_a_real_run_stops_in_one_line(tmp_path):
    bare = {"PATH": "/usr/bin:/bin"}  # no fairseq there
    proc = _cli("bpt-table7", "--dry-run", **bare)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    notes = [line for line in proc.stdout.splitlines() if line.startswith("note: ")]
    install = f"install fairseq with the plugin's fixes: {resources.setup_command()}"  # this copy's command
    assert notes == [f"note: fairseq-generate, fairseq-train not found on PATH (a real run stops there): {install}"]
    real = _cli("bpt-table7", "--gpus", "0", "--stages", "train", "--data-root", str(tmp_path), **bare)
    assert real.returncode != 0 and "Traceback" not in real.stderr
    assert real.stderr.strip().splitlines() == [
        f"fairseq-plugins-reproduce: fairseq-train not found on PATH: {install}"]


def test_more_gpus_than_visible_are_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match=r"bpt-table7 trains on 8 GPUs per node \(the paper's count\), 0 visible"):
        reproduce_table.main(["bpt-table7", "--stages", "train", "--runs-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="bpt-table7 has no rows \\['k99'\\]"):
        reproduce_table.main(["bpt-table7", "--dry-run", "--rows", "k99"])
    with pytest.raises(SystemExit, match="unknown table 'bpt-table99'"):
        reproduce_table.main(["bpt-table99", "--dry-run"])
