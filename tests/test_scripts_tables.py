"""scripts/tables/*.sh: one per paper table, each a call of fairseq_plugins.recipes.reproduce_table whose GPU and
distributed settings reach the fairseq-train commands (run here in their --dry-run mode)."""

import math
import os
import re
import subprocess
from pathlib import Path

import pytest

from fairseq_plugins.recipes.config import all_configs, load_tables, run_key, seed_configs

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "scripts" / "tables").glob("*.sh"))


def test_one_script_per_table():
    assert sorted(p.stem for p in SCRIPTS) == sorted(t.replace("-", "_") for t in load_tables())


def _dry_run(script: Path, tmp_path: Path, **settings) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **settings}
    proc = subprocess.run(["bash", str(script), "--dry-run", "--data-root", str(tmp_path / "data"),
                           "--runs-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results")],
                          env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_dry_run_shows_every_training_run_with_the_settings(script, tmp_path):
    table = next(t for t in load_tables() if t.replace("-", "_") == script.stem)
    configs = [c for c in all_configs() if c["table"] == table]
    out = _dry_run(script, tmp_path, GPUS="2", UPDATE_FREQ="auto", FP16="")
    assert out.startswith(f"{table}: {len(configs)} rows")
    commands = [line for line in out.splitlines() if "fairseq-train" in line]
    runs = [run for c in configs for run in seed_configs(c)]  # one run per seed of the paper's protocol
    assert len(commands) == len({run_key(r) for r in runs})
    by_key = {run_key(r): r for r in runs}
    for command in commands:
        cfg = by_key[re.search(r"--save-dir \S+/runs/(\S+)", command).group(1)]
        paper_freq = int(cfg["train"].get("update-freq", 1))
        assert f"--update-freq {max(1, math.ceil(paper_freq * cfg['gpus'] / 2))} " in command + " "
        assert "--distributed-world-size 2" in command and "--fp16" not in command
    assert (tmp_path / "results" / f"{table}.md").exists()  # the table stage ran


def test_settings_reach_fairseq_train(tmp_path):
    script = REPO / "scripts" / "tables" / "bpt_table7.sh"
    out = _dry_run(script, tmp_path, GPUS="4", UPDATE_FREQ="3", NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1")
    command = next(line for line in out.splitlines() if "fairseq-train" in line)
    assert command.startswith("torchrun --nproc_per_node=4 --nnodes=2 --node_rank=1 --master_addr=10.0.0.1")
    assert "--update-freq 3 " in command and "--distributed-world-size 8" in command and "--fp16" in command
    assert "scripts.evaluate" not in out  # node 1 only trains
    cpu = _dry_run(script, tmp_path, GPUS="0", FP16="")
    assert all("--cpu" in line for line in cpu.splitlines() if "fairseq-train" in line)
