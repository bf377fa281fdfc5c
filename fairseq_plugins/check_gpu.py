"""Everything a GPU owner runs to verify this project's GPU code, in one command.

    python -m fairseq_plugins.check_gpu [--benchmark quick|full|none] [--out PATH]

Runs, on the visible CUDA GPU:

1. the GPU tests (``pytest -m gpu tests``: the fused kernels and every other GPU check);
2. ``compute-sanitizer`` memcheck and initcheck over the kernels' tests, when installed;
3. the GPU benchmark (``scripts/benchmark_cuda_graph_attention.py``);

and writes one Markdown report (GPU model, driver, CUDA, torch, triton, commit; each step's
command, result, time and output tail; the benchmark table) to
``benchmarks/gpu_check_<gpu>_<date>.md``, ready to commit. Exit status 0 when every step
passed. Without a GPU it says so and exits 2, writing nothing.
"""

import argparse
import datetime
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = "tests/test_cuda_ext_gpu.py"
SANITIZER_TOOLS = {  # tool: the kernel tests it runs over (small cases: it is slow)
    "memcheck": "random or rows_without or dropout",
    "initcheck": "random",
}
BENCHMARK_ARGS = {"quick": ["--lengths", "1024", "8192", "--ks", "4"], "full": []}
OUTPUT_TAIL_LINES = 30
NO_GPU_EXIT = 2


class Step(NamedTuple):
    name: str
    command: Optional[List[str]]  # None: skipped
    note: str = ""


@dataclass
class StepResult:
    """One command the check ran and what came of it."""

    name: str
    command: List[str]
    returncode: Optional[int]  # None: skipped
    seconds: float
    output: str
    note: str = ""

    @property
    def status(self) -> str:
        if self.returncode is None:
            return "skipped"
        return "passed" if self.returncode == 0 else f"FAILED (exit {self.returncode})"

    def summary(self) -> str:
        """pytest's final counts line, else the note."""
        counts = re.findall(r"^=* ?(\d+ (?:passed|failed|error).*?)(?: =*)?$", self.output, re.M)
        return counts[-1] if counts else self.note


def find_sanitizer() -> Optional[str]:
    found = shutil.which("compute-sanitizer")
    fallback = Path("/usr/local/cuda/bin/compute-sanitizer")
    return found or (str(fallback) if fallback.is_file() else None)


def plan(benchmark: str, sanitizer: Optional[str], benchmark_out: Path) -> List[Step]:
    """Every step, in order: (name, command or None when skipped, why skipped)."""
    python = sys.executable
    steps = [Step("GPU tests", [python, "-m", "pytest", "-m", "gpu", "-q", "-rs", "tests"])]
    for tool, selection in SANITIZER_TOOLS.items():
        name = f"compute-sanitizer {tool}"
        if sanitizer is None:
            steps.append(Step(name, None, "compute-sanitizer not found (CUDA toolkit)"))
        else:
            steps.append(Step(name, [sanitizer, "--tool", tool, "--error-exitcode", "1", python,
                                     "-m", "pytest", "-q", KERNEL_TESTS, "-k", selection]))
    if benchmark == "none":
        steps.append(Step("benchmark", None, "--benchmark none"))
    else:
        steps.append(Step("benchmark", [python, "scripts/benchmark_cuda_graph_attention.py",
                                        *BENCHMARK_ARGS[benchmark], "--out", str(benchmark_out)]))
    return steps


def run_step(name: str, command: Optional[List[str]], note: str = "") -> StepResult:
    if command is None:
        return StepResult(name, [], None, 0.0, "", note)
    print(f"check_gpu: {name}: {' '.join(command)}", flush=True)
    start = time.time()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    output = result.stdout + result.stderr
    step = StepResult(name, command, result.returncode, time.time() - start, output)
    print(f"check_gpu: {name}: {step.status} in {step.seconds:.0f} s {step.summary()}", flush=True)
    return step


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken: the report says which
        return "not installed"


def _command_output(command: List[str]) -> str:
    try:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def environment() -> Dict[str, str]:
    """GPU model and the versions a reader needs to reproduce the report."""
    import torch

    props = torch.cuda.get_device_properties(0)
    driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "GPU": f"{props.name} ({props.total_memory / 2**30:.0f} GiB, "
               f"compute capability {props.major}.{props.minor})",
        "GPUs visible": str(torch.cuda.device_count()),
        "driver": driver.splitlines()[0] if driver else "unknown (no nvidia-smi)",
        "CUDA (torch build)": str(torch.version.cuda),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "Python": platform.python_version(),
        "commit": _command_output(["git", "rev-parse", "--short", "HEAD"]) or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def render_report(env: Dict[str, str], steps: List[StepResult],
                  benchmark_table: Optional[str]) -> str:
    """The Markdown report: environment, one line per step, the benchmark, output tails."""
    lines = ["# GPU check", "", "`python -m fairseq_plugins.check_gpu`", "",
             "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in env.items()]
    lines += ["", "| step | result | time | summary |", "|---|---|---|---|"]
    for step in steps:
        lines.append(f"| {step.name} | {step.status} | {step.seconds:.0f} s | "
                     f"{step.summary().replace('|', '/')} |")
    verdict = all(step.returncode in (0, None) for step in steps)
    lines += ["", f"**{'All steps that ran passed.' if verdict else 'Some steps failed.'}**"]
    if benchmark_table:
        lines += ["", "## Benchmark", "", benchmark_table.strip()]
    lines += ["", "## Commands and output tails"]
    for step in steps:
        lines += ["", f"### {step.name}: {step.status}", ""]
        if step.returncode is None:
            lines.append(f"Skipped: {step.note}.")
            continue
        tail = "\n".join(step.output.rstrip().splitlines()[-OUTPUT_TAIL_LINES:])
        lines += ["```", " ".join(step.command), "```", "", "```", tail, "```"]
    return "\n".join(lines) + "\n"


def report_path(env_gpu: str, directory: Path) -> Path:
    gpu = re.sub(r"[^a-z0-9]+", "_", env_gpu.split(" (")[0].lower()).strip("_")
    return directory / f"gpu_check_{gpu}_{datetime.date.today():%Y-%m-%d}.md"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmark", choices=["quick", "full", "none"], default="quick",
                        help="quick: n = 1024 and 8192 at k = 4 (minutes); full: the paper's "
                             "grid (an hour or more)")
    parser.add_argument("--out", type=Path, help="report path (default benchmarks/gpu_check_*.md)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(f"check_gpu: no CUDA GPU is visible (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}); nothing was checked and no report was written.")
        return NO_GPU_EXIT
    env = environment()
    out = args.out or report_path(env["GPU"], ROOT / "benchmarks")
    benchmark_out = out.with_name(out.stem + "_benchmark")
    steps = [run_step(*step) for step in plan(args.benchmark, find_sanitizer(), benchmark_out)]
    table = benchmark_out.with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report(env, steps, table.read_text() if table.is_file() else None))
    print(f"check_gpu: report written to {out}")
    return 0 if all(step.returncode in (0, None) for step in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
