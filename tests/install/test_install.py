"""The plugin as a non-editable install: a wheel built from this checkout, installed into a
temporary folder and used from a working directory far from the checkout.

Every process here gets ``PYTHONPATH=<install>``: that entry precedes the site-packages whose
editable finder (appended to ``sys.meta_path``) would otherwise import the checkout, and each
test checks that ``fairseq_plugins`` really comes from the install. The CPU kernel is built
from the install's own copy of ``cpu_ext/`` into an empty ``FAIRSEQ_PLUGINS_CACHE``.
"""

import configparser
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.cli import REPO, TINY_MODEL_ARGS, write_raw_corpus

pytestmark = [pytest.mark.cli, pytest.mark.slow]  # a wheel built and installed; its commands run

# what a wheel must not pick up from a working checkout
NOT_SOURCES = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", "*.so",
                                     ".pytest_cache", "_resources", "runs", "data-bin", "checkpoints", "results",
                                     ".cache", ".whl", ".venv")


def _run(cmd, **kwargs):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kwargs)
    assert proc.returncode == 0, f"{cmd} exited with {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def install(tmp_path_factory):
    """(install folder, environment, far-away working directory) of a wheel built from a copy
    of the checkout (a build in place would reuse a stale build/ folder)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", root / "dist", source])
    wheels = list((root / "dist").glob("fairseq_multiscale_plugins-*.whl"))
    assert len(wheels) == 1, wheels
    site = root / "site"
    _run([*pip, "install", "--no-deps", "--no-index", "--target", site, wheels[0]])
    far = root / "elsewhere"
    far.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), FAIRSEQ_PLUGINS_CACHE=str(root / "cache"),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PATH=os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")]))
    return site, env, far


def _fairseq(command: str) -> str:
    exe = shutil.which(f"fairseq-{command}")
    if exe is None:
        pytest.skip(f"fairseq-{command} is not on PATH: run scripts/setup.sh first")
    return exe


def _python(install, code: str) -> str:
    site, env, far = install
    return _run([sys.executable, "-c", code], env=env, cwd=far).stdout


def test_the_wheel_ships_the_kernel_sources_and_configs(install):
    site, _, _ = install
    resources = site / "fairseq_plugins" / "_resources"
    assert (resources / "cpu_ext" / "csrc" / "graph_attention_cpu.cpp").is_file()
    assert (resources / "cuda_ext" / "csrc" / "graph_attention_kernels.cu").is_file()
    assert (resources / "configs" / "bpt" / "table7.yaml").is_file()
    shipped = {p.relative_to(resources / "configs") for p in (resources / "configs").rglob("*.yaml")}
    assert shipped == {p.relative_to(REPO / "configs") for p in (REPO / "configs").rglob("*.yaml")}


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
    missing = _python(install, "from fairseq_plugins import resources as r; "
                               "print(r.setup_command()); print(r.extra_command('zh'))").splitlines()
    assert missing == ["fairseq-plugins-install-fairseq", 'pip install "fairseq-multiscale-plugins[zh]"']
    from fairseq_plugins import fairseq_build  # the sdist set-up cached, copied into the install's cache

    cached = Path(env["FAIRSEQ_PLUGINS_CACHE"]) / "fairseq-build"
    cached.mkdir(parents=True, exist_ok=True)
    shutil.copy(fairseq_build.sdist(download=False), cached)
    prepared = _run([site / "bin" / "fairseq-plugins-install-fairseq", "--prepare", far / "src"], env=env, cwd=far)
    assert (Path(prepared.stdout.strip()) / "fairseq" / "version.txt").read_text().startswith("0.12.2+plugins.")


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
