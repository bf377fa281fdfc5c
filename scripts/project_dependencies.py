"""Read this project's dependencies from pyproject.toml, for scripts/setup.sh.

    project_dependencies.py [--extra test] [--exclude torch fairseq]   # one requirement a line
    project_dependencies.py --missing ...                              # only the unsatisfied ones
    project_dependencies.py --triton VERSION       # the triton to install, if any (see triton_requirement)
    project_dependencies.py --plugin-current DIR   # exit 0 if the plugin imports from DIR with the
                                                   # version and console commands of pyproject.toml

pyproject.toml stays the one list of dependencies; set-up installs from it.
"""

import argparse
import importlib.metadata
import importlib.util
import sys
import tomllib
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare interpreter still has pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras=(), exclude=()):
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    specs = list(project["dependencies"])
    for extra in extras:
        specs += project["optional-dependencies"][extra]
    return [Requirement(s) for s in specs if Requirement(s).name not in exclude]


def is_satisfied(req: Requirement) -> bool:
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return req.specifier.contains(version, prereleases=True)


def triton_requirement(wanted: str) -> str:
    """What set-up installs for the Triton backend: nothing when the installed torch pins a
    triton (its CUDA builds do) and it is installed; the pinned one when it is missing; else
    (a CPU torch) ``triton==wanted``, the version the CUDA builds of the supported torch pin,
    so that the CPU tests (interpreter, sm_80/sm_90a compile) check what GPU users run."""
    pins = [Requirement(r) for r in importlib.metadata.requires("torch") or []]
    pins = [r for r in pins if r.name == "triton" and (r.marker is None or r.marker.evaluate())]
    if pins:
        return "" if is_satisfied(pins[0]) else str(pins[0])
    wanted_req = Requirement(f"triton=={wanted}")
    return "" if is_satisfied(wanted_req) else str(wanted_req)


def plugin_is_current(location: Path) -> bool:
    """The plugin imports from ``location``, and its installed metadata has this checkout's
    version and console commands (an editable install made before they changed has not)."""
    spec = importlib.util.find_spec("fairseq_plugins")
    if not (spec and spec.origin and Path(spec.origin).parent == location):
        return False
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    try:
        dist = importlib.metadata.distribution(project["name"])
    except importlib.metadata.PackageNotFoundError:
        return False
    version = (location / "__init__.py").read_text().split('__version__ = "', 1)[1].split('"', 1)[0]
    commands = {ep.name for ep in dist.entry_points if ep.group == "console_scripts"}
    return dist.version == version and commands == set(project.get("scripts", {}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", nargs="*", default=[])
    parser.add_argument("--exclude", nargs="*", default=[])
    parser.add_argument("--missing", action="store_true", help="print only unsatisfied requirements")
    parser.add_argument("--plugin-current", type=Path, metavar="DIR")
    parser.add_argument("--triton", metavar="VERSION")
    args = parser.parse_args()
    if args.triton:
        print(triton_requirement(args.triton))
        return
    if args.plugin_current:
        sys.exit(0 if plugin_is_current(args.plugin_current.resolve()) else 1)
    reqs = requirements(args.extra, args.exclude)
    if args.missing:
        print(" ".join(str(r) for r in reqs if not is_satisfied(r)))
    else:
        print("\n".join(str(r) for r in reqs))


if __name__ == "__main__":
    main()
