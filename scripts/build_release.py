"""Build what a release ships into one folder: the plugin's sdist and wheel, and the fixed
fairseq's wheel for each Python given. The release workflow (.github/workflows/release.yml)
runs it; run it the same way here before tagging:

    python scripts/build_release.py                                  # plugin only, into dist/
    python scripts/build_release.py --python python3.11 --python python3.12 --python python3.13
    python scripts/build_release.py --no-plugin --python python3.12  # one fairseq wheel

The plugin is built as ``python -m build`` builds it, without its isolation (so it works
offline, with the setuptools of the running Python, which must satisfy pyproject.toml's
build-system): the sdist first, then the wheel from the unpacked sdist, so a file the sdist
forgets fails the wheel's build here, not a user's install. Each fairseq wheel is built by
that Python (``python -m fairseq_plugins.fairseq_build``, from this checkout's package): the
fixed 0.12.2 sdist in pip's isolated build environment, which pip fills from the package
registry. The fairseq wheels land in its cache first (``FAIRSEQ_PLUGINS_CACHE``), so a second
run with the same fixes copies them. Prints one line per artifact: name, size, seconds.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# PEP 517's hooks, run in a child whose working directory is the source tree: print the file's name
_HOOK = "import sys; from setuptools import build_meta as b; print(b.build_{kind}(sys.argv[1]))"


def _run(cmd, **kwargs) -> str:
    """stdout of ``cmd``; its failure ends the script with its output and the command."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        sys.exit(f"build_release: {' '.join(map(str, cmd))} exited with {proc.returncode}")
    return proc.stdout


def _hook(kind: str, source: Path, out: Path) -> Path:
    """Run setuptools' build_sdist or build_wheel in ``source`` (its build/ and egg-info stay there)."""
    name = _run([sys.executable, "-c", _HOOK.format(kind=kind), out], cwd=source).strip().splitlines()[-1]
    return out / name


def build_plugin(dist: Path, source: Path = ROOT) -> list:
    """The plugin's sdist from ``source`` (a checkout), then its wheel from that sdist; both in ``dist``."""
    sdist = _hook("sdist", source, dist)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(sdist) as archive:
            archive.extractall(tmp, filter="data")
        (source,) = Path(tmp).iterdir()
        wheel = _hook("wheel", source, dist)
    return [sdist, wheel]


def build_fairseq(python: str, dist: Path) -> Path:
    """The fixed fairseq's wheel for ``python``, copied from fairseq_build's cache into ``dist``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cached = Path(_run([python, "-m", "fairseq_plugins.fairseq_build"], env=env, cwd=ROOT).strip().splitlines()[-1])
    return Path(shutil.copy(cached, dist))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="the folder the artifacts go to (dist/)")
    parser.add_argument("--python", action="append", default=[], metavar="PYTHON",
                        help="an interpreter (name on PATH or path) to build the fixed fairseq's wheel for; "
                             "repeat for several")
    parser.add_argument("--no-plugin", dest="plugin", action="store_false",
                        help="skip the plugin's sdist and wheel")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    for python in args.python:
        if shutil.which(python) is None:
            sys.exit(f"build_release: --python {python}: no such interpreter")
    args.dist.mkdir(parents=True, exist_ok=True)
    steps = [("plugin", lambda: build_plugin(args.dist))] if args.plugin else []
    steps += [(python, lambda python=python: [build_fairseq(python, args.dist)]) for python in args.python]
    for what, step in steps:
        started = time.monotonic()
        print(f"[release] building {what}", file=sys.stderr, flush=True)
        for path in step():
            print(f"{path.name}  {path.stat().st_size / 1e6:.2f} MB  {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
