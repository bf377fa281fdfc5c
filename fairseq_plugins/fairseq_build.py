"""Build fairseq 0.12.2 from its PyPI sdist, with the plugin's fixes in its source, into a local wheel.

    fairseq-plugins-install-fairseq                       # build (once, cached) and pip-install it
    fairseq-plugins-install-fairseq --prepare DIR         # only the fixed source, unpacked into DIR (no build)
    python -m fairseq_plugins.fairseq_build               # print the wheel's path; build it only if not cached

The wheel's version carries the fixes' label (``0.12.2+plugins.<hash>``, see
``fairseq_plugins/fairseq_fixes.py``) and its metadata declares the dependencies that work,
so pip installs, checks and uninstalls it like any package. The cache
(``$FAIRSEQ_PLUGINS_CACHE/fairseq-build``, by default ``~/.cache/fairseq_plugins/fairseq-build``)
keeps the sdist and one wheel per set of fixes and Python version: a machine builds fairseq
once (about 2 minutes on 2 quiet cores), whatever the number of checkouts and environments.
"""

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

from . import fairseq_fixes  # imports no fairseq
from .command_line import CommandError, command_parser, exit_code
from .resources import cache_root

SDIST_NAME = f"fairseq-{fairseq_fixes.SUPPORTED_FAIRSEQ_VERSION}.tar.gz"


def cache_dir() -> Path:
    return cache_root() / "fairseq-build"  # beside the compiled kernels' cache


def _pip(*args, fix: str = "") -> None:
    """Run pip; its failure is a CommandError (one line after pip's own message), with ``fix``."""
    code = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args]).returncode
    if code:
        raise CommandError(f"pip {args[0]} exited with {code} (its message is above){fix}")


def sdist(download: bool = True) -> Path:
    """The cached fairseq 0.12.2 sdist, downloaded from PyPI when absent (and allowed)."""
    path = cache_dir() / SDIST_NAME
    if not path.exists():
        if not download:
            raise FileNotFoundError(
                f"{path} is missing: run fairseq-plugins-install-fairseq (it downloads and builds fairseq)"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"[build] downloading {SDIST_NAME} from PyPI", file=sys.stderr)
        _pip("download", "-q", "--no-deps", "--no-binary", "fairseq", "-d", str(path.parent),
             f"fairseq=={fairseq_fixes.SUPPORTED_FAIRSEQ_VERSION}",
             fix=f"; without network, copy {SDIST_NAME} from PyPI into {path.parent}")
    return path


def prepare(dest: Path) -> fairseq_fixes.SourceTree:
    """Unpack the sdist into dest and apply the fixes (and the local version label) to it."""
    with tarfile.open(sdist()) as archive:
        archive.extractall(dest, filter="data")
    tree = fairseq_fixes.SourceTree(Path(dest) / SDIST_NAME[: -len(".tar.gz")])
    fairseq_fixes.apply(tree)
    return tree


def cached_wheel() -> Optional[Path]:
    """The cached wheel for this set of fixes and this Python, or None."""
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    matches = sorted((cache_dir() / "wheels").glob(f"fairseq-{fairseq_fixes.local_version()}-{python}-*.whl"))
    return matches[0] if matches else None


def build() -> Path:
    """The fixed wheel, built unless cached."""
    if cached_wheel():
        return cached_wheel()
    with tempfile.TemporaryDirectory() as tmp:
        tree = prepare(Path(tmp) / "src")
        print(f"[build] building fairseq {fairseq_fixes.local_version()} (about 2 minutes on 2 cores)", file=sys.stderr)
        # Built in pip's isolated environment on purpose: without torch there, setup.py skips
        # the C++ extensions (libnat, libbase) that translation does not use.
        _pip("wheel", "-q", "--no-deps", "-w", str(Path(tmp) / "out"), str(tree.root))
        (built,) = (Path(tmp) / "out").glob("fairseq-*.whl")
        (cache_dir() / "wheels").mkdir(parents=True, exist_ok=True)
        shutil.move(str(built), cache_dir() / "wheels" / built.name)
    return cached_wheel()


def install() -> Path:
    """Build the fixed wheel unless cached, then pip-install it into this Python's environment."""
    wheel = build()
    print(f"[build] installing {wheel.name}", file=sys.stderr)
    _pip("install", "-q", str(wheel))
    return wheel


def main(argv=None, install_by_default: bool = False) -> int:
    parser = command_parser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--prepare", type=Path, metavar="DIR",
                        help="only unpack fairseq's sdist (downloaded once into the cache) into DIR and apply "
                             "the fixes; print the source folder (no build, no install)")
    action.add_argument("--install", action="store_true",
                        help="also pip-install the wheel into this environment"
                             + (" (the default of this command)" if install_by_default else ""))
    parser.set_defaults(install=install_by_default)
    args = parser.parse_args(argv)
    if args.prepare:
        print(prepare(args.prepare).root)
    else:
        print(install() if args.install else build())
    return 0


def install_main() -> int:
    """Console command ``fairseq-plugins-install-fairseq``: ``main`` that installs unless told otherwise."""
    return exit_code(lambda: main(sys.argv[1:], install_by_default=True))


if __name__ == "__main__":
    sys.exit(main())
