"""The developer scripts of ``scripts/`` that the README names, run as a developer would."""

import os
import subprocess

import pytest

from tests.cli import REPO

pytestmark = pytest.mark.cli  # every test here runs a program of scripts/


def test_test_script_runs_only_the_paths_given(tmp_path):
    """``bash scripts/test.sh FILE`` runs that file alone, with pytest's options passed through
    (the set-up skipped: SETUP=done)."""
    (tmp_path / "test_one.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    proc = subprocess.run(["bash", "scripts/test.sh", str(tmp_path / "test_one.py"), "--co", "-q", "-k", "test_a"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, SETUP="done", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = [line for line in proc.stdout.splitlines() if ".py: " in line]  # pytest's path: relative to where
    assert len(collected) == 1 and collected[0].endswith("test_one.py: 1"), proc.stdout[-2000:]
