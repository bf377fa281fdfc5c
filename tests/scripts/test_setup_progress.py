"""scripts/setup.sh says what each step does and how long it took, and while a long step runs
(pip downloading torch, fairseq's build) a line every PROGRESS_SECONDS (30 s), not minutes of
silence (scripts/setup_progress.sh, run here with a 1 s period)."""

import re
import subprocess
import time

import pytest

from tests.cli import REPO

pytestmark = pytest.mark.cli  # each test runs a part of scripts/setup.sh in bash


def run_step(command: str, seconds: int = 1):
    script = f"set -euo pipefail; PROGRESS_SECONDS={seconds}; . scripts/setup_progress.sh; {command}"
    started = time.monotonic()
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - started


def test_a_long_step_says_it_is_running_then_its_time():
    proc, _ = run_step('step "installing something" sleep 3.5')
    first, *progress, last = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert first == "[setup] installing something"
    # one a second (bash counts whole seconds, and a busy machine may delay one)
    seconds = [int(re.fullmatch(r"\[setup\]   \.\.\. (\d+) s so far", line)[1]) for line in progress]
    assert len(seconds) in (2, 3) and seconds == sorted(seconds) and 1 <= seconds[0] <= 2, progress
    assert re.fullmatch(r"\[setup\]   done in [34] s", last), last


def test_a_failed_step_says_so_and_returns_its_status():
    proc, _ = run_step('step "installing something" bash -c "exit 3" || echo "status $?"')
    assert proc.stdout.splitlines() == ["[setup] installing something", "[setup]   failed after 0 s", "status 3"]


def test_the_progress_lines_end_with_the_step_and_hold_no_reader():
    """Once the step is over, nothing is left that keeps the output open: a caller that reads
    it to the end (a pipe, a test's capture) returns at once, not a period later."""
    proc, elapsed = run_step('step "quick" true; echo after', seconds=30)
    assert proc.stdout.splitlines() == ["[setup] quick", "[setup]   done in 0 s", "after"]
    assert elapsed < 10
