"""``python -m fairseq_plugins.check_gpu`` (console command ``fairseq-plugins-check-gpu``):
everything a GPU owner runs to verify this project's GPU code, from a checkout or an
installed copy.

Steps, each in its own process with a timeout and its whole output in a log:

1. the headline (``headline``, first, so that the check answers the speed question even when
   it is stopped later): the graph attention at n 8192, k 4, bf16, 8 heads x 64, forward and
   backward, one process per backend (SDPA pinned to FlashAttention, flex, triton, cuda),
   each row written as soon as it is measured; speed-ups over SDPA and flex on wall-clock
   and GPU-kernel time;
2. the GPU tests (``gpu_tests``), one process per group: the triton kernels, the CUDA
   extension (skipped, with the reason, without ``nvcc``), FlexAttention, the torch backend
   and ``auto``;
3. ``compute-sanitizer`` memcheck over the triton and CUDA groups' small cases, when the
   CUDA toolkit has it (PyTorch's caching allocator off, so that an access past a tensor is
   an access past an allocation);
4. the op benchmark (``op_benchmark``): forward and backward, dropout off and on, against
   SDPA (FlashAttention), FlexAttention and the torch backend, with a profiler split and the
   error against float64;
5. one training update of each model against the transformer (``model_update``);
6. one training update of ``bpt_lm`` against ``transformer_lm`` at contexts up to 16,384
   (``lm_update``), the long-context workload BPT was built for.

Writes ``gpu_check_<gpu>_<date>.md`` and ``.json`` and the logs folder beside them, in
``--out`` (default: ``benchmarks/`` of the checkout the command runs in, else the current
folder). Exit status 0 when every step that ran passed, 1 otherwise; without a GPU it says
so, writes nothing and exits 2.
"""

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from fairseq_plugins.check_gpu.headline import BACKENDS as HEADLINE_BACKENDS
from fairseq_plugins.check_gpu.headline import markdown as headline_markdown
from fairseq_plugins.check_gpu.lm_update import markdown as lm_markdown
from fairseq_plugins.check_gpu.model_update import markdown as update_markdown
from fairseq_plugins.check_gpu.op_benchmark import markdown as benchmark_markdown
from fairseq_plugins.check_gpu.runner import Progress, Step, StepResult, python_env, run_steps
from fairseq_plugins.command_line import command_parser
from fairseq_plugins.graph_attention.registry import AUTO_CANDIDATES, OWN_GPU_KERNELS

PACKAGE = Path(__file__).resolve().parents[1]  # the fairseq_plugins this command belongs to
NO_GPU_EXIT = 2
# timeout and estimate (s) of a backend's test group: the fast ones (the cuda group's first
# call builds the extension), and the torch reference (what auto falls back to)
FAST_TEST_TIMES, REFERENCE_TEST_TIMES = (3600, 900), (1800, 300)
TEST_GROUPS = {  # group: (test module, backend, timeout s, estimate s)
    **{name: ("test_backend", name, *(REFERENCE_TEST_TIMES if name == "torch" else FAST_TEST_TIMES))
       for name in AUTO_CANDIDATES},
    "auto": ("test_selection", None, *REFERENCE_TEST_TIMES),
}
SANITIZED = OWN_GPU_KERNELS
SANITIZER_TIMEOUT_S, SANITIZER_ESTIMATE_S = 3600, 1200
BENCHMARKS = {  # preset: op benchmark, model update and LM update options, estimate s, timeout s
    "full": ([], [], [], 2400, 7200),
    "quick": (["--lengths", "1024", "8192", "--ks", "4"], ["--updates", "3"],
              ["--contexts", "1024", "8192", "--ks", "4", "--checkpointed-ks", "--recomputed-ks",
               "--updates", "3"], 300, 1800),
}
BENCHMARK_STEPS = ("op benchmark", "model update", "language-model update")
# one headline backend's process: a first call compiles (flex, triton) or builds (cuda)
HEADLINE_TIMEOUT_S, HEADLINE_ESTIMATE_S = 900, 90
HEADLINE_JSON = "headline.json"


def find_sanitizer() -> Optional[str]:
    found = shutil.which("compute-sanitizer")
    fallback = Path("/usr/local/cuda/bin/compute-sanitizer")
    return found or (str(fallback) if fallback.is_file() else None)


def find_nvcc() -> Optional[str]:
    """nvcc where torch's extension builder looks: CUDA_HOME, else PATH."""
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        CUDA_HOME = None
    if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").is_file():
        return str(Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


def pytest_command(module: str, *extra: str) -> List[str]:
    return [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", "--pyargs",
            f"fairseq_plugins.check_gpu.gpu_tests.{module}", *extra]


def plan(args, sanitizer: Optional[str], nvcc: Optional[str], log_dir: Path) -> List[Step]:
    """Every step in order; a skipped one has no command and says why."""
    base_env = {**python_env(PACKAGE.parent), "FAIRSEQ_PLUGINS_CHECK_DEVICE": args.device,
                "FAIRSEQ_PLUGINS_CHECK_SIZE": args.size}
    if args.device != "cpu":
        base_env["TRITON_INTERPRET"] = None  # compile the kernels for the GPU
    no_nvcc = "nvcc not found (CUDA_HOME or PATH): the CUDA extension cannot be built"
    steps = []
    for backend in HEADLINE_BACKENDS:  # a backend that cannot run here writes a row saying why
        command = [sys.executable, "-m", "fairseq_plugins.check_gpu.headline", "--backend", backend,
                   "--out", str(log_dir / HEADLINE_JSON), "--device", args.device, *args.headline_option]
        skip = "--benchmark none" if args.benchmark == "none" else ""
        steps.append(Step(f"headline: {backend}", None if skip else command, HEADLINE_TIMEOUT_S,
                          HEADLINE_ESTIMATE_S, base_env, skip))
    for group in args.groups:
        module, backend, timeout, estimate = TEST_GROUPS[group]
        env = {**base_env, "FAIRSEQ_PLUGINS_CHECK_BACKEND": backend or ""}
        skip = no_nvcc if group == "cuda" and nvcc is None else ""
        steps.append(Step(f"tests: {group}", None if skip else pytest_command(module), timeout,
                          estimate, env, skip, concurrent=True))
    for group in (g for g in SANITIZED if g in args.groups):
        module, backend, _, _ = TEST_GROUPS[group]
        skip = ("compute-sanitizer not found (CUDA toolkit)" if sanitizer is None else
                no_nvcc if group == "cuda" and nvcc is None else
                "--no-sanitizer" if not args.sanitizer else "")
        command = [sanitizer or "compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1",
                   "--target-processes", "all", *pytest_command(module)]
        env = {**base_env, "FAIRSEQ_PLUGINS_CHECK_BACKEND": backend,
               "FAIRSEQ_PLUGINS_CHECK_SIZE": "small", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
        steps.append(Step(f"compute-sanitizer memcheck: {group}", None if skip else command,
                          SANITIZER_TIMEOUT_S, SANITIZER_ESTIMATE_S, env, skip, concurrent=True))
    if args.benchmark in ("none", "headline"):
        for name in BENCHMARK_STEPS:
            steps.append(Step(name, None, 0, 0, skip_reason=f"--benchmark {args.benchmark}"))
        return cap_timeouts(steps, args.step_timeout)
    op_options, update_options, lm_options, estimate, timeout = BENCHMARKS[args.benchmark]
    backends = ["sdpa", *(name for name in AUTO_CANDIDATES if name != "cuda" or nvcc)]
    op = [sys.executable, "-m", "fairseq_plugins.check_gpu.op_benchmark", "--out",
          str(log_dir / "op_benchmark.json"), "--device", args.device, "--backends", *backends,
          *op_options, *args.benchmark_option]
    steps.append(Step("op benchmark", op, timeout, estimate, base_env))
    update = [sys.executable, "-m", "fairseq_plugins.check_gpu.model_update", "--out",
              str(log_dir / "model_update.json"), "--device", args.device, *update_options,
              *args.update_option]
    steps.append(Step("model update", update, timeout / 4, estimate / 8, base_env))
    lm = [sys.executable, "-m", "fairseq_plugins.check_gpu.lm_update", "--out", str(log_dir / "lm_update.json"),
          "--device", args.device, *lm_options, *args.lm_option]
    steps.append(Step("language-model update", lm, timeout / 4, estimate / 4, base_env))
    return cap_timeouts(steps, args.step_timeout)


def cap_timeouts(steps: List[Step], limit: Optional[float]) -> List[Step]:
    """Every step's timeout at most ``limit`` seconds (None: as planned), its estimate too."""
    if limit is not None:
        for step in steps:
            step.timeout_s, step.estimate_s = min(step.timeout_s, limit), min(step.estimate_s, limit)
    return steps


def _command_output(command: List[str], cwd=None) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60,
                              cwd=cwd).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def source_version() -> str:
    """The checkout's commit (with ``+changes`` when it has uncommitted ones), else the
    installed distribution's version."""
    commit = _command_output(["git", "rev-parse", "--short", "HEAD"], cwd=PACKAGE)
    if commit and _command_output(["git", "rev-parse", "--show-toplevel"], cwd=PACKAGE) == str(PACKAGE.parent):
        dirty = _command_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PACKAGE)
        return f"commit {commit}{' +changes' if dirty else ''}"
    names = importlib.metadata.packages_distributions().get(PACKAGE.name, [])
    for name in names:
        try:
            return f"{name} {importlib.metadata.version(name)} (installed)"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown (neither a git checkout nor an installed distribution)"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken: the report says which
        return "not installed"


def environment(device: str) -> Dict[str, str]:
    """The device and the versions a reader needs to reproduce the report."""
    import torch

    env = {}
    if device != "cpu":
        props = torch.cuda.get_device_properties(device)
        driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["GPU"] = (f"{props.name} ({props.total_memory / 2**30:.0f} GiB, compute capability "
                      f"{props.major}.{props.minor})")
        env["GPUs visible"] = str(torch.cuda.device_count())
        env["driver"] = driver.splitlines()[0] if driver else "unknown (no nvidia-smi)"
    else:
        env["GPU"] = f"none: a CPU run ({platform.processor() or platform.machine()})"
    nvcc = find_nvcc()
    env.update({
        "CUDA (torch build)": str(torch.version.cuda),
        "nvcc": (_command_output([nvcc, "--version"]).splitlines() or ["?"])[-1] if nvcc else "not found",
        "compute-sanitizer": find_sanitizer() or "not found",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "Python": platform.python_version(),
        "source": source_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    })
    return env


def default_out_dir(cwd: Path) -> Path:
    """``benchmarks/`` of the checkout ``cwd`` is in, else ``cwd``."""
    for folder in (cwd, *cwd.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "fairseq_plugins").is_dir():
            return folder / "benchmarks"
    return cwd


def report_stem(gpu: str) -> str:
    name = re.sub(r"[^a-z0-9]+", "_", gpu.split(" (")[0].split(":")[0].lower()).strip("_")
    return f"gpu_check_{name}_{datetime.date.today():%Y-%m-%d}"


def _read_json(path: Path) -> Optional[Dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def render_report(env: Dict[str, str], results: List[StepResult], benchmark: Optional[Dict],
                  update: Optional[Dict], out_dir: Path, lm: Optional[Dict] = None,
                  headline: Optional[Dict] = None) -> str:
    """The Markdown report: environment, one line per step, the measurements (the headline
    first), the tails of the steps that failed (every step's whole log is in the logs folder)."""
    lines = ["# GPU check", "", "`python -m fairseq_plugins.check_gpu`", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in env.items()]
    lines += ["", "| step | result | time | summary | log |", "|---|---|---|---|---|"]
    for r in results:
        log = f"[{r.log.name}]({r.log.relative_to(out_dir)})" if r.log else "-"
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.0f} s | "
                     f"{r.summary().replace('|', '/')} | {log} |")
    verdict = all(r.ok for r in results)
    lines += ["", f"**{'Every step that ran passed.' if verdict else 'Some steps failed.'}**"]
    if headline:
        lines += ["", "## The headline: graph attention against SDPA and flex", "",
                  headline_markdown(headline).strip()]
    if benchmark:
        lines += ["", "## Graph attention per op", "", benchmark_markdown(benchmark).strip()]
    if update:
        lines += ["", "## One training update per model", "", update_markdown(update).strip()]
    if lm:
        lines += ["", "## Language models at long context", "", lm_markdown(lm).strip()]
    failed = [r for r in results if not r.ok]
    if failed:
        lines += ["", "## Failed steps: command and last lines (whole logs beside this report)"]
    for r in failed:
        lines += ["", f"### {r.name}: {r.status}", "", "```", " ".join(r.command), "```", "",
                  "```", r.tail, "```"]
    return "\n".join(lines) + "\n"


def report_json(env, results: List[StepResult], benchmark, update, out_dir: Path, lm=None, headline=None) -> Dict:
    return {"environment": env, "passed": all(r.ok for r in results),
            "steps": [{"name": r.name, "status": r.status, "returncode": r.returncode,
                       "timed_out": r.timed_out, "seconds": round(r.seconds, 1),
                       "summary": r.summary(), "command": r.command,
                       "log": str(r.log.relative_to(out_dir)) if r.log else None}
                      for r in results],
            "headline": headline, "op_benchmark": benchmark, "model_update": update, "lm_update": lm}


def parser() -> argparse.ArgumentParser:
    p = command_parser(prog="fairseq-plugins-check-gpu",
                       description=__doc__.splitlines()[0].strip("`") + " GPU check.",
                       epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", type=Path, help="folder of the report (default: benchmarks/ of the "
                   "checkout this runs in, else the current folder)")
    p.add_argument("--benchmark", choices=["full", "quick", "headline", "none"], default="full",
                   help="full: the headline, the tests, then n 1024-16384 x k 1/4/16/64 (about "
                        "an hour) and the model updates; quick: the same at n 1024 and 8192, k 4 "
                        "(minutes); headline: only the headline (n 8192, k 4, one process per "
                        "backend) before the tests; none: the tests only")
    p.add_argument("--groups", nargs="+", choices=list(TEST_GROUPS), default=list(TEST_GROUPS),
                   help="GPU test groups to run")
    p.add_argument("--no-sanitizer", dest="sanitizer", action="store_false",
                   help="skip compute-sanitizer")
    p.add_argument("--size", choices=["full", "small"], default="full",
                   help="the GPU tests' cases: all, or the small ones only")
    p.add_argument("--headline-option", action="append", default=[], metavar="OPTION",
                   help="passed on to each headline process (repeat: --headline-option=--n "
                        "--headline-option=64)")
    p.add_argument("--benchmark-option", action="append", default=[], metavar="OPTION",
                   help="passed on to the op benchmark (repeat: --benchmark-option=--iters "
                        "--benchmark-option=20)")
    p.add_argument("--update-option", action="append", default=[], metavar="OPTION",
                   help="passed on to the model update")
    p.add_argument("--lm-option", action="append", default=[], metavar="OPTION",
                   help="passed on to the language-model update")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run up to N of the test and compute-sanitizer steps at once (they take "
                        "no timings; the benchmark steps always run alone: the headline before "
                        "them, the rest after)")
    p.add_argument("--step-timeout", type=float, metavar="SECONDS",
                   help="at most this long for each step (default: each step's own timeout, up "
                        "to 2 hours): a step stopped by it is reported as timed out")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="the whole check within this: a step running then is stopped, the steps "
                        "not started are skipped, and the report is written")
    p.add_argument("--device", default="cuda",
                   help="cuda (default), or cpu: the same steps on the CPU, to test this command")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.jobs < 1 or any(limit is not None and limit <= 0 for limit in (args.step_timeout, args.time_limit)):
        p.error("--jobs, --step-timeout and --time-limit must be positive")
    start = time.time()
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        print(f"check_gpu: no CUDA GPU is visible (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}); nothing was checked and no report was written.")
        return NO_GPU_EXIT
    if importlib.util.find_spec("pytest") is None:
        print("check_gpu: its GPU tests run with pytest, which is not installed: pip install pytest")
        return 1
    env = environment(args.device)
    out_dir = (args.out or default_out_dir(Path.cwd())).resolve()
    stem = report_stem(env["GPU"])
    log_dir = out_dir / f"{stem}_logs"
    steps = plan(args, find_sanitizer(), find_nvcc(), log_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / HEADLINE_JSON).unlink(missing_ok=True)  # rows of an earlier check today
    progress = Progress(steps, jobs=args.jobs)
    print(f"check_gpu: {len(steps)} steps; report and logs in {out_dir}", flush=True)
    deadline = start + args.time_limit if args.time_limit else None
    results = run_steps(steps, log_dir, progress, args.jobs, cwd=log_dir, deadline=deadline)
    benchmark = _read_json(log_dir / "op_benchmark.json")
    update = _read_json(log_dir / "model_update.json")
    lm = _read_json(log_dir / "lm_update.json")
    headline = _read_json(log_dir / HEADLINE_JSON)
    report = out_dir / f"{stem}.md"
    report.write_text(render_report(env, results, benchmark, update, out_dir, lm, headline))
    report.with_suffix(".json").write_text(
        json.dumps(report_json(env, results, benchmark, update, out_dir, lm, headline), indent=1) + "\n")
    print(f"check_gpu: report written to {report} and {report.with_suffix('.json').name}, "
          f"logs in {log_dir}")
    return 0 if all(r.ok for r in results) else 1
