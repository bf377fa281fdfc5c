"""fairseq is installed cleanly: the fixes go into the 0.12.2 sdist, pip installs the built wheel.

These tests read the sdist that scripts/setup.sh cached (it downloads and builds fairseq once
per machine) and the installed fairseq; none of them builds fairseq again.
"""

import base64
import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile

import pytest

from fairseq_plugins import fairseq_fixes
from fairseq_plugins.fairseq_fixes import APPLIED, MISSING, FairseqFixError, SourceTree
from fairseq_plugins import fairseq_build as build_fairseq_wheel
from tests.cli import REPO


@pytest.fixture(scope="module")
def pristine_sdist(tmp_path_factory):
    """The original fairseq 0.12.2 source, unpacked from the cached sdist."""
    dest = tmp_path_factory.mktemp("sdist")
    with tarfile.open(build_fairseq_wheel.sdist(download=False)) as archive:
        archive.extractall(dest, filter="data")
    return dest / "fairseq-0.12.2"


def _files(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_fixes_apply_to_the_original_source_once(pristine_sdist, tmp_path):
    tree = SourceTree(shutil.copytree(pristine_sdist, tmp_path / "src"))
    assert set(fairseq_fixes.check(tree).values()) == {MISSING}
    assert set(fairseq_fixes.apply(tree).values()) == {"applied now"}
    once = _files(tree.root)
    assert set(fairseq_fixes.apply(tree).values()) == {"already applied"}
    assert _files(tree.root) == once
    assert fairseq_fixes.check(tree) == {fix.name: APPLIED for fix in fairseq_fixes.FIXES}
    assert tree.version() == fairseq_fixes.local_version()
    setup_py = (tree.root / "setup.py").read_text()
    assert "torchaudio" not in setup_py and '"hydra-core>=1.3.2"' in setup_py


def test_build_script_prepares_the_fixed_source(tmp_path):
    """The script's tiny mode: unpack the cached sdist and fix it, without building."""
    out = subprocess.run([sys.executable, "-m", "fairseq_plugins.fairseq_build", "--prepare", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    tree = SourceTree(out.strip())
    assert set(fairseq_fixes.check(tree).values()) == {APPLIED}


def test_unknown_source_text_is_refused(pristine_sdist, tmp_path):
    tree = SourceTree(shutil.copytree(pristine_sdist, tmp_path / "src"))
    (tree.root / "fairseq/checkpoint_utils.py").write_text("state = something_else()\n")
    with pytest.raises(FairseqFixError, match="unknown fairseq source in fairseq/checkpoint_utils.py"):
        fairseq_fixes.apply(tree)


def test_other_fairseq_versions_are_refused(pristine_sdist, tmp_path, monkeypatch):
    tree = SourceTree(shutil.copytree(pristine_sdist, tmp_path / "src"))
    (tree.root / "fairseq/version.txt").write_text("0.13.0")
    with pytest.raises(FairseqFixError, match="0.13.0 at .*0.12.2 only"):
        fairseq_fixes.apply(tree)
    monkeypatch.setattr(fairseq_fixes, "installed_fairseq_version", lambda: "0.13.0")
    assert fairseq_fixes.main(["check"]) == 2


def test_the_installed_fairseq_is_the_fixed_wheel_untouched():
    """Version label, declared dependencies, and every installed file as pip's RECORD lists it:
    nothing was edited in place after pip installed the wheel."""
    dist = importlib.metadata.distribution("fairseq")
    assert dist.version == fairseq_fixes.local_version()
    requires = set(dist.requires)
    assert {"hydra-core>=1.3.2", "omegaconf>=2.3.0"} <= requires
    assert not any(r.startswith("torchaudio") for r in requires)
    changed = []
    for f in dist.files:
        if f.hash is None:  # RECORD itself, and files compiled after installation
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(f.locate().read_bytes()).digest()).rstrip(b"=").decode()
        if digest != f.hash.value:
            changed.append(str(f))
    assert not changed


def test_pip_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_editable_install_of_the_plugin_resolves_offline():
    """`pip install -e .` finds every requirement (fairseq==0.12.2 included) already satisfied."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
         "--disable-pip-version-check", "-e", "."],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Would install fairseq-multiscale-plugins" in proc.stdout, proc.stdout
