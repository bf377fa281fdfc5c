"""Runs each step of the check in its own process: a timeout, the whole output kept in a log,
and progress with an estimate of the time left on the console.

A process of its own per step, because the first illegal memory access breaks the CUDA
context of the process it happens in and would hide every later result; a timeout, because a
hung kernel must not hang the check; the full log, because a failure's cause is rarely in
the last lines.
"""

import os
import re
import shlex
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional

PROGRESS = "check_gpu progress:"  # a step's output lines with this prefix reach the console
TAIL_LINES = 60
KILL_GRACE_S = 10


@dataclass
class Step:
    """One command of the check; ``command`` None means skipped, for ``skip_reason``."""

    name: str
    command: Optional[List[str]]
    timeout_s: float
    estimate_s: float  # for the time-left estimate
    env: Dict[str, Optional[str]] = field(default_factory=dict)  # None: removed
    skip_reason: str = ""
    concurrent: bool = False  # takes no timings: may run beside other such steps (--jobs)

    @property
    def log_name(self) -> str:
        return re.sub(r"[^a-z0-9]+", "_", self.name.lower()).strip("_") + ".log"


@dataclass
class StepResult:
    name: str
    command: List[str]
    returncode: Optional[int]  # None: skipped
    seconds: float
    log: Optional[Path] = None
    tail: str = ""
    timed_out: bool = False
    note: str = ""

    @property
    def status(self) -> str:
        if self.returncode is None:
            return "skipped"
        if self.timed_out:
            return f"TIMED OUT after {self.seconds:.0f} s"
        return "passed" if self.returncode == 0 else f"FAILED (exit {self.returncode})"

    @property
    def ok(self) -> bool:
        return self.returncode is None or (self.returncode == 0 and not self.timed_out)

    def summary(self) -> str:
        """pytest's final counts line, else the note."""
        counts = re.findall(r"^=* ?(\d+ (?:passed|failed|error|skipped|deselected).*?)(?: =*)?$",
                            self.tail, re.M)
        return counts[-1] if counts else self.note


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Prints where the check is and about how long is left: the estimates of the steps not
    yet finished, less the time the running ones have run, the concurrent steps' shared among
    ``jobs`` processes."""

    def __init__(self, steps: List[Step], out: Callable[[str], None] = print, jobs: int = 1):
        self.steps, self.out, self.jobs, self.start = steps, out, jobs, time.time()
        self.started: Dict[int, float] = {}
        self.finished: set = set()
        self._lock = threading.Lock()

    def left(self) -> float:
        now, concurrent, serial = time.time(), 0.0, 0.0
        for index, step in enumerate(self.steps):
            if index in self.finished or step.command is None:
                continue
            remaining = max(0.0, step.estimate_s - (now - self.started.get(index, now)))
            if step.concurrent:
                concurrent += remaining
            else:
                serial += remaining
        return concurrent / self.jobs + serial

    def begin(self, index: int, step: Optional[Step] = None) -> None:
        """Step ``index`` starts (``step``: as it runs, when its timeout was shortened)."""
        self.started[index] = time.time()
        step = step or self.steps[index]
        what = (f"skipped: {step.skip_reason}" if step.command is None else
                f"running (timeout {format_duration(step.timeout_s)})")
        self.say(f"[{index + 1}/{len(self.steps)}] {step.name}: {what}")

    def end(self, index: int) -> None:
        self.finished.add(index)

    def say(self, message: str) -> None:
        with self._lock:  # concurrent steps' readers print from their own threads
            self.out(f"check_gpu {format_duration(time.time() - self.start)} elapsed, about "
                     f"{format_duration(self.left())} left: {message}")


def run_steps(steps: List[Step], log_dir: Path, progress: Progress, jobs: int = 1,
              cwd: Optional[Path] = None, deadline: Optional[float] = None) -> List[StepResult]:
    """Every step, in order: runs of ``concurrent`` steps up to ``jobs`` at a time, every
    other step alone (its timings undisturbed). With a ``deadline`` (``time.time()``), a step
    is stopped at it and one not started by then is skipped. Results in the steps' order."""
    results: List[Optional[StepResult]] = [None] * len(steps)

    def one(index: int) -> None:
        step = steps[index]
        if deadline is not None and step.command is not None:
            left = deadline - time.time()
            step = (replace(step, timeout_s=min(step.timeout_s, left)) if left >= 1 else
                    replace(step, command=None, skip_reason="not started: the time limit was reached"))
        progress.begin(index, step)
        results[index] = run_step(step, log_dir, progress, cwd)
        progress.end(index)

    index = 0
    while index < len(steps):
        batch = [index]
        while steps[index].concurrent and batch[-1] + 1 < len(steps) and steps[batch[-1] + 1].concurrent:
            batch.append(batch[-1] + 1)
        if len(batch) == 1 or jobs == 1:
            for i in batch:
                one(i)
        else:
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                list(pool.map(one, batch))
        index = batch[-1] + 1
    return results


def run_step(step: Step, log_dir: Path, progress: Optional[Progress] = None,
             cwd: Optional[Path] = None) -> StepResult:
    """Run ``step`` with its whole output in ``log_dir/<name>.log``; kill its process group at
    the timeout."""
    if step.command is None:
        return StepResult(step.name, [], None, 0.0, note=step.skip_reason)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / step.log_name
    env = dict(os.environ)
    for key, value in step.env.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    start = time.time()
    with log.open("w", encoding="utf-8") as out:
        changed = " ".join(f"{k}={'(unset)' if v is None else shlex.quote(v)}" for k, v in step.env.items())
        out.write(f"$ {changed} {shlex.join(step.command)}\n".replace("$  ", "$ "))
        out.flush()
        process = subprocess.Popen(step.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, errors="replace", env=env, cwd=cwd,
                                   start_new_session=True)

        def copy():
            for line in process.stdout:
                out.write(line)
                out.flush()
                if line.startswith(PROGRESS) and progress is not None:
                    progress.say(f"{step.name}: {line[len(PROGRESS):].strip()}")

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        timed_out = False
        try:
            returncode = process.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            returncode = _stop(process)
        reader.join(timeout=KILL_GRACE_S)
        if timed_out:
            out.write(f"\ncheck_gpu: killed after the {step.timeout_s:.0f} s timeout\n")
    text = log.read_text(encoding="utf-8", errors="replace")
    tail = "\n".join(text.rstrip().splitlines()[-TAIL_LINES:])
    result = StepResult(step.name, step.command, returncode, time.time() - start, log, tail,
                        timed_out)
    if progress is not None:
        progress.say(f"{step.name}: {result.status} in {format_duration(result.seconds)} "
                     f"{result.summary()}".rstrip())
    return result


def _stop(process: subprocess.Popen) -> int:
    """SIGTERM to the step's process group, SIGKILL after a grace period; the exit status."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            return process.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
    return process.wait()


def python_env(package_root: Path) -> Dict[str, Optional[str]]:
    """Environment that makes a child process import the same ``fairseq_plugins`` as this one
    (an installed copy, a checkout, or a worktree run from its root)."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(package_root) + (os.pathsep + path if path else "")}
