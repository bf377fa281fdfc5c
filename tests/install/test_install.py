"""The plugin as a release ships it: the sdist of this checkout (``scripts/build_release.py``, as
the release workflow builds it), the wheel built from that sdist, installed into a temporary
folder and used from a working directory far from the checkout.

Every process here gets ``PYTHONPATH=<install>``: that entry precedes the site-packages whose
editable finder (appended to ``sys.meta_path``) would otherwise import the checkout, and each
test checks that ``fairseq_plugins`` really comes from the install. The CPU kernel is built
from the install's own copy of ``cpu_ext/`` into an empty ``FAIRSEQ_PLUGINS_CACHE``.
"""

import configparser
import os
import shutil
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from scripts.build_release import build_plugin
from tests.cli import REPO, TINY_MODEL_ARGS, write_raw_corpus

pytestmark = [pytest.mark.cli, pytest.mark.slow]  # a wheel built and installed; its commands run


def _run(cmd, **kwargs):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kwargs)
    assert proc.returncode == 0, f"{cmd} exited with {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _git_files(*args: str) -> list:
    """``git ls-files`` of this checkout, or [] without git (the tests run from an unpacked sdist)."""
    proc = subprocess.run(["git", "-C", REPO, "ls-files", "-z", *args], capture_output=True, text=True)
    return proc.stdout.strip("\0").split("\0") if proc.returncode == 0 and proc.stdout else []


def _tracked(*folders: str) -> set:
    """The files git tracks in this checkout (under ``folders``), or a skip without git."""
    files = set(_git_files("--", *folders))
    if not files:
        pytest.skip("not a git checkout: the files git tracks are unknown")
    return files


def _copy_sources(dest: Path) -> None:
    """The checkout's sources into ``dest``: the files git does not ignore (tracked or new, never
    a run's outputs or a stale build/); without git, the whole tree less compiled files."""
    files = _git_files("--cached", "--others", "--exclude-standard")
    if not files:
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info"))
        return
    for name in files:
        if (REPO / name).is_file():  # a tracked file deleted in the working tree is not a source
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(sdist, wheel) of a copy of the checkout (a build in place would reuse a stale build/ folder)."""
    root = tmp_path_factory.mktemp("release")
    _copy_sources(root / "source")
    return build_plugin(root / "dist", root / "source")


@pytest.fixture(scope="module")
def install(release, tmp_path_factory):
    """(install folder, environment, far-away working directory) of the release's wheel."""
    root = tmp_path_factory.mktemp("install")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    site = root / "site"
    _run([*pip, "install", "--no-deps", "--no-index", "--target", site, release[1]])
    far = root / "elsewhere"
    far.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), FAIRSEQ_PLUGINS_CACHE=str(root / "cache"),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PATH=os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")]))
    return site, env, far


def test_the_sdist_holds_the_repository_and_its_tests_run_from_it(release, tmp_path):
    """Every tracked file but the clone's own tooling (.ci/, dotfiles) is in the sdist, so the
    tests find their conftest.py, helpers and fixtures at any depth; pytest collects them there."""
    sdist, _ = release
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
        archive.extractall(tmp_path, filter="data")
    top = sdist.name[: -len(".tar.gz")]
    shipped = {name[len(top) + 1:] for name in names if name.startswith(top + "/")}
    expected = {f for f in _tracked() if not f.startswith((".ci/", ".gitignore", ".pre-commit"))}
    assert expected - shipped == set()
    assert not [n for n in shipped if n.endswith((".pyc", ".so", ".o"))]
    unpacked = tmp_path / top
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                                "-p", "no:cacheprovider", "tests"], cwd=unpacked, capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=str(unpacked), OMP_NUM_THREADS="1"), timeout=600)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert re.match(r"\d+ tests collected", collected.stdout.splitlines()[-1]), collected.stdout[-500:]


def test_the_wheel_holds_the_package_and_what_it_reads_at_run_time(release):
    """The wheel is the package (every tracked file of it) plus the top-level folders it reads at
    run time under ``_resources/`` (configs, the kernel sources); no tests, scripts or docs."""
    _, wheel = release
    with zipfile.ZipFile(wheel) as archive:
        files = {n for n in archive.namelist() if ".dist-info/" not in n}
    package = {f for f in _tracked("fairseq_plugins")}
    resources = {f"fairseq_plugins/_resources/{f}" for f in _tracked("configs", "cpu_ext", "cuda_ext")}
    assert files == package | resources


def _fairseq(command: str) -> str:
    exe = shutil.which(f"fairseq-{command}")
    if exe is None:
        pytest.skip(f"fairseq-{command} is not on PATH: run scripts/setup.sh first")
    return exe


def _python(install, code: str) -> str:
    site, env, far = install
    return _run([sys.executable, "-c", code], env=env, cwd=far).stdout


def test_the_package_imports_from_the_install_not_the_checkout(install):
    site, _, _ = install
    out = _python(install, "import fairseq_plugins, fairseq_plugins.resources as r; "
                           "print(fairseq_plugins.__file__); print(r.resource_dir('cpu_ext'))")
    module, cpu_ext = out.split()
    assert Path(module) == site / "fairseq_plugins" / "__init__.py"
    assert Path(cpu_ext) == site / "fairseq_plugins" / "_resources" / "cpu_ext"


def test_console_commands_resolve_and_run_from_the_install(install):
    site, env, far = install
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    entry_points = configparser.ConfigParser()
    (dist_info,) = site.glob("fairseq_multiscale_plugins-*.dist-info")
    entry_points.read(dist_info / "entry_points.txt")
    assert dict(entry_points["console_scripts"]) == declared
    # every entry point's module imports from the install and names a callable
    check = "\n".join([
        "import importlib, sys",
        f"site = {str(site)!r}",
        f"for target in {sorted(declared.values())!r}:",
        "    module, name = target.split(':')",
        "    m = importlib.import_module(module)",
        "    assert m.__file__.startswith(site), (module, m.__file__)",
        "    assert callable(getattr(m, name)), target",
        "print('ok')",
    ])
    assert _python(install, check).strip() == "ok"
    for command in declared:
        assert (site / "bin" / command).is_file(), command
    train = site / "bin" / "fairseq-plugins-train"
    assert "TABLE:ROW_ID" in _run([train, "--help"], env=env, cwd=far).stdout
    dry = _run([train, "bpt-table7:bpt-k4", "--dry-run", "--world-size", "0"], env=env, cwd=far).stdout
    assert "fairseq-train" in dry and "--arch bpt" in dry
    assert f"--user-dir {site / 'fairseq_plugins'}" in dry


def test_an_install_without_fairseq_names_the_command_that_exists_there(install):
    """``pip install .`` without ``fairseq-plugins-install-fairseq`` (here: Python without its
    site-packages, so without fairseq): the command's one line names that console command, not
    the clone's scripts/setup.sh, and the --prepare it offers works from the install."""
    site, env, far = install
    code = ("import sys; sys.argv = ['fairseq-plugins-train', 'bpt/table7_bpt_k4']; "
            "from fairseq_plugins.recipes.console import train; sys.exit(train())")
    proc = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=far, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("fairseq-plugins-train: error: fairseq is not installed; run "
                                  "fairseq-plugins-install-fairseq (it installs the fixed fairseq 0.12.2)")
    # the import of the plugin's tasks (what --user-dir does first) says the same, in one line
    proc = subprocess.run([sys.executable, "-S", "-c", "import fairseq_plugins.tasks"], env=env, cwd=far,
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "error: fairseq is not installed; run fairseq-plugins-install-fairseq" in proc.stderr
    missing = _python(install, "from fairseq_plugins import resources as r; "
                               "print(r.setup_command()); print(r.extra_command('zh'))").splitlines()
    assert missing == ["fairseq-plugins-install-fairseq", 'pip install "fairseq-multiscale-plugins[zh]"']
    from fairseq_plugins import fairseq_build  # the sdist set-up cached, copied into the install's cache

    cached = Path(env["FAIRSEQ_PLUGINS_CACHE"]) / "fairseq-build"
    cached.mkdir(parents=True, exist_ok=True)
    shutil.copy(fairseq_build.sdist(download=False), cached)
    prepared = _run([site / "bin" / "fairseq-plugins-install-fairseq", "--prepare", far / "src"], env=env, cwd=far)
    assert (Path(prepared.stdout.strip()) / "fairseq" / "version.txt").read_text().startswith("0.12.2+plugins.")


@pytest.fixture(scope="module")
def unfixed_fairseq(tmp_path_factory):
    """A site folder with a copy of the installed fairseq (and its .dist-info, so its version
    label still says fixed) from which one fix is taken back out: a fairseq built for an older
    set of fixes, or a stock one, as ``--user-dir`` meets it."""
    from fairseq_plugins import fairseq_fixes

    try:
        installed = fairseq_fixes.fairseq_package_dir().parent
        dist_info = fairseq_fixes._installed_metadata_file().parent
    except fairseq_fixes.FairseqFixError:
        pytest.skip("fairseq is not installed: run scripts/setup.sh first")
    site = tmp_path_factory.mktemp("unfixed")
    for folder in ("fairseq", "fairseq_cli", dist_info.name):
        shutil.copytree(installed / folder, site / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (fix,) = [f for f in fairseq_fixes.FIXES if f.name == "hub_task_encoders"]  # changes nothing at import
    for edit in fix.edits:
        path = site / edit.path
        path.write_text(path.read_text().replace(edit.new, edit.old, 1))
    return site


@pytest.mark.parametrize("copy, command", [("install", "fairseq-plugins-install-fairseq"),
                                           ("clone", f"bash {REPO / 'scripts' / 'setup.sh'}")])
def test_user_dir_with_an_unfixed_fairseq_ends_in_one_line(install, unfixed_fairseq, copy, command):
    """fairseq-train --user-dir (of the install, or of the clone) on a fairseq without the fixes:
    fairseq imports the plugin's tasks first, whose check ends the command with one line that
    names the command to run for that copy (no traceback, before any data is read)."""
    site, env, far = install
    user_dir = site / "fairseq_plugins" if copy == "install" else REPO / "fairseq_plugins"
    env = dict(env, PYTHONPATH=os.pathsep.join([str(unfixed_fairseq), str(site)]))
    proc = subprocess.run([_fairseq("train"), far / "no-data-bin", "--user-dir", user_dir, "--arch", "bpt_transformer"],
                          env=env, cwd=far, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("fairseq-train: error: the installed fairseq 0.12.2+plugins."), proc.stderr
    assert "['hub_task_encoders']: run " + command + ", which installs" in proc.stderr


def test_tiny_bpt_trains_from_the_install_with_the_cpu_kernel(install):
    """fairseq-train --user-dir <install>/fairseq_plugins; ``auto`` builds the CPU kernel from
    the install's sources into the empty cache and uses it (about a minute of compiling)."""
    site, env, far = install
    user_dir = site / "fairseq_plugins"
    raw = write_raw_corpus(far / "raw", n_train=100, n_eval=20, max_len=16)
    _run([_fairseq("preprocess"), "--source-lang", "en", "--target-lang", "de", "--trainpref", raw / "train",
          "--validpref", raw / "valid", "--destdir", far / "data-bin", "--workers", "1"], env=env, cwd=far)
    log = _run([
        _fairseq("train"), far / "data-bin", "--user-dir", user_dir, "--arch", "bpt_transformer", *TINY_MODEL_ARGS,
        "--graph-attention-backend", "auto", "--optimizer", "adam", "--lr", "0.005", "--max-tokens", "1000",
        "--max-update", "6", "--save-dir", far / "ckpt", "--no-epoch-checkpoints", "--no-progress-bar",
        "--log-format", "simple", "--log-interval", "2", "--num-workers", "0", "--seed", "1", "--cpu",
    ], env=env, cwd=far).stdout  # fmt: skip
    assert "done training" in log
    assert (far / "ckpt" / "checkpoint_last.pt").is_file()
    # the training built the CPU kernel, from a copy of the install's sources, into the fresh cache
    cache = Path(env["FAIRSEQ_PLUGINS_CACHE"]) / "cpu_ext"
    (ninja,) = cache.glob("*/build/build.ninja")
    copy = ninja.parent / "src" / "graph_attention_cpu.cpp"
    assert str(copy) in ninja.read_text()
    assert copy.read_bytes() == (user_dir / "_resources" / "cpu_ext" / "csrc" / "graph_attention_cpu.cpp").read_bytes()
    built = ninja.parent.parent
    assert (built / "fairseq_plugins_graph_attention_cpu.so").is_file()
    # and "auto" resolves to it in the same install (loading that build, not rebuilding)
    out = _python(install, "\n".join([
        "import torch",
        "from fairseq_plugins.graph_attention import cpu_backend, registry",
        "from fairseq_plugins.graphs.binary_partition import bpt_graph",
        "graph = bpt_graph(8, 2)",
        "print(registry.DEFAULT.auto(torch.zeros(2, 2, graph.num_nodes, 16), graph))",
        "print(cpu_backend.SOURCE_DIR)",
        "print(cpu_backend.load_extension().__file__)",
    ]))
    backend, source_dir, module = out.split()
    assert backend == "cpu"
    assert Path(source_dir) == user_dir / "_resources" / "cpu_ext" / "csrc"
    assert Path(module).parent == built
