"""The project's release metadata agrees with itself: one version number, written once in
``fairseq_plugins/__init__.py``, is what pip sees and what the changelog's newest entry names."""

import importlib.metadata
import re
import tomllib

import fairseq_plugins
from tests.cli import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


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
