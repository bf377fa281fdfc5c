"""The ``cli`` mark cannot be missed (tests/markers.py): a test reaching ``run_cli`` gets it, and
a test that starts a command without it fails there, naming the command."""

import os
import subprocess
import sys

from tests.cli import REPO
from tests.markers import command_name

PROGRAM = [sys.executable, "-m", "scripts.no_such_program"]  # classified as a command, fails at once

SUITE = f"""
import subprocess
import pytest
from tests.cli import run_cli

PROGRAM = {PROGRAM!r}


@pytest.mark.cli
def test_marked():
    subprocess.run(PROGRAM, capture_output=True)


def test_unmarked():
    subprocess.run(PROGRAM, capture_output=True)


def test_unmarked_and_caught():
    try:
        subprocess.run(PROGRAM, capture_output=True)
    except Exception:
        pass


def helper():
    return run_cli("fairseq-no-such-command")


def test_through_a_helper():
    with pytest.raises(FileNotFoundError):
        helper()


def test_plain_python():
    subprocess.run(["{sys.executable}", "-c", "pass"], check=True)
"""


def test_the_commands_that_need_the_mark():
    assert command_name(["/venv/bin/fairseq-train", "data-bin"]) == "fairseq-train"
    assert command_name(["fairseq-plugins-reproduce", "--list"]) == "fairseq-plugins-reproduce"
    assert command_name([sys.executable, "-m", "fairseq_cli.train"]) == "python -m fairseq_cli.train"
    assert command_name([sys.executable, "-m", "scripts.quality_study"]) == "python -m scripts.quality_study"
    assert command_name("bash scripts/setup.sh") == "bash scripts/setup.sh"
    for other in ([sys.executable, "-c", "pass"], [sys.executable, "-m", "pip", "check"], ["nvcc", "-V"],
                  [sys.executable, "-m", "pytest", "tests"], [sys.executable, "-m"]):
        assert command_name(other) is None, other


def _pytest(tmp_path, *args):
    (tmp_path / "test_suite.py").write_text(SUITE)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", "-n", "0", "-p",
                           "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning", *args,
                           str(tmp_path / "test_suite.py")], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_an_unmarked_command_fails_where_it_starts(tmp_path):
    proc = _pytest(tmp_path, "-rf")
    assert "2 failed, 3 passed" in proc.stdout, proc.stdout[-3000:]
    for test in ("test_unmarked", "test_unmarked_and_caught"):
        assert (f"test_suite.py::{test} runs `python -m scripts.no_such_program` in a subprocess without "
                f"the `cli` mark") in proc.stdout, proc.stdout[-3000:]


def test_a_test_reaching_run_cli_gets_the_mark(tmp_path):
    proc = _pytest(tmp_path, "--collect-only", "-m", "cli")
    collected = sorted(line.split("::")[-1] for line in proc.stdout.splitlines() if "::" in line)
    assert collected == ["test_marked", "test_through_a_helper"], proc.stdout[-3000:]
