"""Read this project's dependencies from pyproject.toml, for scripts/setup.sh.

    project_dependencies.py [--extra test] [--exclude torch fairseq]   # one requirement a line
    project_dependencies.py --missing ...                              # only the unsatisfied ones
    project_dependencies.py --plugin-location                          # where fairseq_plugins imports from

pyproject.toml stays the one list of dependencies; set-up installs from it.
"""

import argparse
import importlib.metadata
import importlib.util
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", nargs="*", default=[])
    parser.add_argument("--exclude", nargs="*", default=[])
    parser.add_argument("--missing", action="store_true", help="print only unsatisfied requirements")
    parser.add_argument("--plugin-location", action="store_true")
    args = parser.parse_args()
    if args.plugin_location:
        spec = importlib.util.find_spec("fairseq_plugins")
        print(Path(spec.origin).parent if spec and spec.origin else "")
        return
    reqs = requirements(args.extra, args.exclude)
    if args.missing:
        print(" ".join(str(r) for r in reqs if not is_satisfied(r)))
    else:
        print("\n".join(str(r) for r in reqs))


if __name__ == "__main__":
    main()
