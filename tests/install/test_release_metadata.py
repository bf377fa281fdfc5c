"""The project's release metadata agrees with itself: one version number, written once in
``fairseq_plugins/__init__.py``, is what pip sees and what the changelog's newest entry names;
the release workflow builds for the Pythons the package declares, with the script the README
names, and publishes nothing, as the README says. (``test_install.py`` beside it builds the plugin's
sdist and wheel with that script and checks their contents.)"""

import importlib.metadata
import re
import tomllib

import yaml

import fairseq_plugins
from scripts import build_release
from tests.cli import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"


def test_pyproject_reads_the_version_from_the_package():
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fairseq_plugins.__version__"}


def test_installed_metadata_has_the_package_version():
    """An install made before the version changed fails here: rerun scripts/setup.sh."""
    assert importlib.metadata.version(PYPROJECT["project"]["name"]) == fairseq_plugins.__version__


def test_changelog_newest_entry_is_the_package_version():
    text = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    released = [v for v in re.findall(r"^## \[([^\]]+)\]", text, flags=re.MULTILINE) if v != "Unreleased"]
    assert released, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' entry"
    assert released[0] == fairseq_plugins.__version__
    assert re.search(rf"^## \[{re.escape(released[0])}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, flags=re.MULTILINE)


def test_license_file_is_the_declared_license():
    """An SPDX expression (setuptools deprecates the table form) and the file it points to."""
    assert PYPROJECT["project"]["license"] == "MIT" and PYPROJECT["project"]["license-files"] == ["LICENSE"]
    assert not [c for c in PYPROJECT["project"]["classifiers"] if c.startswith("License ::")]
    assert (REPO / "LICENSE").read_text(encoding="utf-8").startswith("MIT License\n")


def _steps(job: dict) -> list:
    return [step.get("run", "") for step in job["steps"]]


def test_the_release_workflow_builds_the_fairseq_wheel_of_every_declared_python():
    jobs = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    declared = sorted(c.rsplit(" :: ", 1)[1] for c in PYPROJECT["project"]["classifiers"]
                      if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert PYPROJECT["project"]["requires-python"] == f">={declared[0]}"
    assert sorted(jobs["fairseq"]["strategy"]["matrix"]["python-version"]) == declared
    assert any("scripts/build_release.py --no-plugin --python python " in run for run in _steps(jobs["fairseq"]))
    assert any("scripts/build_release.py --dist dist" in run for run in _steps(jobs["plugin"]))
    # the workflow installs the build-system the script builds with (it builds without isolation)
    (build_system,) = PYPROJECT["build-system"]["requires"]
    assert any(f'pip install "{build_system}"' in run for run in _steps(jobs["plugin"]))
    # every option the workflow passes is one the script takes
    for run in _steps(jobs["plugin"]) + _steps(jobs["fairseq"]):
        for line in run.splitlines():
            if "scripts/build_release.py" in line:
                args = line.split("scripts/build_release.py", 1)[1].split()
                assert build_release.parse_args(args).dist.name == "dist", line


def test_the_release_workflow_publishes_nothing_as_the_readme_says():
    text = WORKFLOW.read_text().lower()
    assert not [word for word in ("pypi-publish", "twine", "secrets.", "gh release", "upload-release")
                if word in text]
    assert yaml.safe_load(WORKFLOW.read_text())["permissions"] == {"contents": "read"}
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert "nothing is published on PyPI yet" in readme and "scripts/build_release.py" in readme
