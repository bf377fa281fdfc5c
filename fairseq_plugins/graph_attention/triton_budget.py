"""Every Triton that a supported torch pins, compiled for sm_80 and sm_90a and held to the budget.

The suite compiles the launched kernels with the installed Triton only
(``tests/graph_attention/test_triton_compile.py``), but a GPU user runs the Triton their torch pins, and
each version's compiler allocates registers differently. This check installs each version
of ``PINS`` with pip into its own folder (``pip install --no-deps --target``, kept under
``$FAIRSEQ_PLUGINS_CACHE/triton/<version>``) and runs ``triton_aot`` under it in a
subprocess whose ``sys.path`` starts with that folder, so the global ``triton`` is never
imported there. Every launched binary must stay within ``triton_aot``'s limits: at most
``triton_aot.MAX_REGISTERS`` registers, zero spills, shared memory within the block limit,
the tensor-core product in the tile kernels.

    python -m fairseq_plugins.graph_attention.triton_budget [--versions 3.6.0 3.7.1] [--out PREFIX]

``--out benchmarks/triton_budget`` writes ``.json`` (every report) and ``.md`` (the tables
``docs/cuda_ext.md`` cites). Exit status 1 when a binary breaks the budget or a version's
compile fails; a version pip cannot install (no package registry reachable) is skipped,
with its reason on one line.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from ..command_line import command_parser
from ..resources import PACKAGE_DIR, cache_root
from . import triton_aot

# Triton version -> the torch releases whose Linux wheels pin it (their METADATA)
PINS = {"3.6.0": "torch 2.10.0, 2.11.0", "3.7.0": "torch 2.12.0", "3.7.1": "torch 2.12.1, 2.13.0",
        "3.8.0": "torch 2.14.0, 2.14.1 (triton~=3.8.0)"}


# checked by default: the pins of the supported torch (pyproject: torch < 2.15)
DEFAULT_VERSIONS = ["3.6.0", "3.7.0", "3.7.1", "3.8.0"]


class Unavailable(RuntimeError):
    """pip could not install the version (no registry reachable, no wheel for this platform)."""


def install(version: str, cache: Path) -> Path:
    """The folder holding Triton ``version``, installed there by pip once (cached); the
    install goes to a scratch folder first, so an interrupted one leaves nothing behind."""
    folder = cache / "triton" / version
    if (folder / f"triton-{version}.dist-info").is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{version}-", dir=folder.parent))
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
                               "--target", str(scratch), f"triton=={version}"],
                              capture_output=True, text=True)
        if done.returncode:
            lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
            where = "; ".join(line.removeprefix("Looking in ") for line in lines if line.startswith("Looking in"))
            raise Unavailable(f"pip could not install triton=={version}{f' ({where})' if where else ''}: "
                              f"{(errors or lines or ['no output'])[-1]}")
        shutil.rmtree(folder, ignore_errors=True)
        scratch.rename(folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def compile_under(folder: Path, capabilities: List[int], workers: int, kernels=None) -> Dict[str, object]:
    """``triton_aot``'s reports of every launched binary, compiled by the Triton in
    ``folder`` in a subprocess (that folder first on its ``sys.path``, then this package's):
    {"triton": version, "triton_path": where it was imported from, "reports": [...]}."""
    folder = folder.absolute()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(folder), str(PACKAGE_DIR.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "reports.json"
        done = subprocess.run([sys.executable, "-m", "fairseq_plugins.graph_attention.triton_aot", "--capabilities",
                               *map(str, capabilities), "--workers", str(workers), "--json", str(out),
                               *(["--kernels", *kernels] if kernels else [])],
                              env=env, capture_output=True, text=True)
        if not out.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the compile under {folder} failed (exit {done.returncode}): {last}\n"
                               f"{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
    if Path(result["triton_path"]).parent != folder:
        raise RuntimeError(f"the compile imported triton {result['triton']} from {result['triton_path']}, "
                           f"not from {folder}")
    return result


def problems(reports: List[triton_aot.CompileReport]) -> List[str]:
    """One line per binary that breaks the budget."""
    return [f"{r.configuration} sm_{r.capability}: {'; '.join(r.problems())}" for r in reports if r.problems()]


def markdown(results: Dict[str, Dict[str, object]]) -> str:
    """The tables of ``--out``'s ``.md``: per version and target the budget's verdict and
    the extremes, then per binary the registers under every version (in the order of
    ``triton_aot.variants``), then the tile loops' instruction counts on sm_90a."""
    checked = {v: triton_aot.reports_from(r) for v, r in results.items() if r["status"] == "checked"}
    lines = ["# Triton versions: the launched binaries against the budget", "",
             f"Written by `python -m fairseq_plugins.graph_attention.triton_budget --out benchmarks/triton_budget`. "
             f"Budget: at most {triton_aot.MAX_REGISTERS} registers a thread, zero spills, shared memory within "
             "the block limit, the tensor-core product in every tile kernel. At the cap: binaries that use all the "
             "registers their launch allows (`max_registers`, ptxas's maxnreg), where ptxas fitted the kernel "
             "into the cap.", "",
             "| Triton | pinned by | target | binaries | most registers | at the cap | spills | most shared KiB | "
             "fewest blocks/SM | tensor cores | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for version, result in results.items():
        if version not in checked:
            lines.append(f"| {version} | {PINS.get(version, '')} | - | - | - | - | - | - | - | - | "
                         f"{result['status']}: {result['reason']} |")
            continue
        for capability in sorted({r.capability for r in checked[version]}):
            rs = [r for r in checked[version] if r.capability == capability]
            bad = problems(rs)
            lines.append(
                f"| {version} | {PINS.get(version, '')} | {triton_aot.TARGETS[capability][0]} | {len(rs)} | "
                f"{max(r.registers for r in rs)} | {sum(r.registers == r.configuration.max_registers for r in rs)} | "
                f"{sum(r.spill_stores + r.spill_loads for r in rs)} | "
                f"{max(r.shared for r in rs) / 1024:.1f} | {min(r.blocks_per_sm for r in rs)} | "
                f"{'all' if all(r.tensor_core is not False for r in rs) else 'MISSING'} | "
                f"{'within budget' if not bad else f'{len(bad)} over budget'} |")
    if not checked:
        return "\n".join(lines) + "\n"
    versions = list(checked)
    capabilities = sorted({r.capability for rs in checked.values() for r in rs})
    lines += ["", "## Registers per binary", "",
              "a / b / c / d: the tile kernels without dropout (a: no relative keys or padding, b: relative keys and "
              "padding), then with dropout (c, d); the dQ merge without / with relative keys; the other merges have "
              "one binary. Launch: the tile's M x N "
              "(the merges: M rows), warps, stages and register cap, per target; where a later Triton launches a "
              "binary differently (`triton_backend.TRITON_CHANGES`), its launch from that version on follows.", "",
              "| dtype | kernel | D | " + " | ".join(f"sm_{c} launch" for c in capabilities) + " | "
              + " | ".join(f"{v} sm_{c}" for v in versions for c in capabilities) + " |",
              "|---|---|---|" + "---|" * (len(capabilities) * (1 + len(versions)))]
    rows = {}
    for version, rs in checked.items():
        for r in rs:
            c = r.configuration
            row = rows.setdefault((c.dtype, c.kernel, c.head_dim), {})
            launch = f"{c.block_m} x {c.block_n}, {c.num_warps} w, {c.num_stages} s" + (
                f", cap {c.max_registers}" if c.max_registers else "")
            row.setdefault(("launch", r.capability), {}).setdefault(launch, version)  # the first version with it
            row.setdefault((version, r.capability), []).append(r.registers)
    for (dtype, kernel, dim), row in sorted(rows.items()):
        cells = ["; ".join(launch if i == 0 else f"from {version}: {launch}"
                           for i, (launch, version) in enumerate(row.get(("launch", c), {"-": None}).items()))
                 for c in capabilities]
        cells += [" / ".join(map(str, row.get((v, c), ["-"]))) for v in versions for c in capabilities]
        lines.append(f"| {dtype} | {kernel} | {dim} | " + " | ".join(cells) + " |")
    lines += ["", "## Tile loops on sm_90a", "",
              "Static instructions a thread issues per iteration of each tile kernel's loop (one tile), from the "
              "binary's SASS (`triton_aot.tile_loop`), without dropout, without and with relative keys and padding "
              "(rel.+pad.); stall: the control bits' fixed stall cycles over the loop.", "",
              "| Triton | dtype | kernel | D | rel.+pad. | total | tensor core | floating point | integer and address "
              "| predicate | memory | conversion | uniform | sync and control | stall cycles |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for version, rs in checked.items():
        for r in rs:
            c = r.configuration
            if r.capability != 90 or c.dropout or c.kernel in triton_aot.NO_PRODUCTS or not r.loop:
                continue
            loop = r.loop
            lines.append(f"| {version} | {c.dtype} | {c.kernel} | {c.head_dim} | "
                         f"{'on' if c.rel_and_padding else 'off'} | {loop['total']} | "
                         + " | ".join(str(loop[k]) for k in ("tensor core", "floating point", "integer and address",
                                                             "predicate", "memory", "conversion", "uniform",
                                                             "sync and control", "stall_cycles")) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = command_parser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=DEFAULT_VERSIONS,
                        help="Triton versions to check (default: the pins of the torch releases, %(default)s)")
    parser.add_argument("--capabilities", type=int, nargs="+", default=sorted(triton_aot.TARGETS),
                        choices=sorted(triton_aot.TARGETS), help="compute capabilities to compile for (default: all)")
    parser.add_argument("--kernels", nargs="+", metavar="KERNEL",
                        help="check only these kernels' configurations (default: every launched one)")
    parser.add_argument("--workers", type=int, default=2, help="compiling processes (default: %(default)s)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="where the versions are installed (default: $FAIRSEQ_PLUGINS_CACHE, else "
                             "~/.cache/fairseq_plugins)")
    parser.add_argument("--out", type=Path, help="also write PREFIX.json (every report) and PREFIX.md (the tables)")
    args = parser.parse_args(argv)
    results, failed = {}, False
    for version in args.versions:
        try:
            folder = install(version, args.cache or cache_root())
        except Unavailable as e:
            print(f"[triton_budget] SKIP Triton {version}: {e}", flush=True)
            results[version] = {"status": "skipped", "reason": str(e)}
            continue
        try:
            result = compile_under(folder, args.capabilities, args.workers, args.kernels)
        except RuntimeError as e:
            print(f"FAIL Triton {version}: {e}", file=sys.stderr)
            results[version], failed = {"status": "failed", "reason": str(e).splitlines()[0]}, True
            continue
        bad = problems(triton_aot.reports_from(result))
        failed |= bool(bad)
        results[version] = {"status": "checked", "pinned_by": PINS.get(version, ""), **result}
        print(f"[triton_budget] Triton {version} ({PINS.get(version, 'not a pin')}): {len(result['reports'])} "
              f"binaries, {'within budget' if not bad else f'{len(bad)} over budget'}", flush=True)
        for line in bad:
            print(f"FAIL Triton {version}: {line}", file=sys.stderr)
    text = markdown(results)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        for suffix, content in ((".json", json.dumps(results, indent=1) + "\n"), (".md", text)):
            args.out.with_name(args.out.name + suffix).write_text(content)  # PREFIX may hold dots (3.6.0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
