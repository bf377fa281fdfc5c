"""Every command that README.md and docs/*.md show runs as written.

The commands are read from the whole text of each page (code blocks, inline code and prose):

- ``fairseq-plugins-*``: a console command of ``pyproject.toml``'s ``[project.scripts]``, whose
  entry point (this checkout's code) answers ``--help``;
- ``python -m <module>`` (this project's) and ``python scripts/<file>.py``: answer ``--help``
  from the repository root; other modules (pytest, venv) are importable;
- fairseq's own ``fairseq-*`` commands: console commands of the installed fairseq whose module
  exists (not run: each takes several seconds to import fairseq);
- ``scripts/...sh``, ``scripts/...py`` and ``tests/...py`` paths: exist.

So a renamed command, module or script fails here, naming the page that still shows it.
"""

import functools
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Set

import pytest
from tests.cli import REPO

ROOT = REPO
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OURS = re.compile(r"(?<![\w/.-])(fairseq-plugins-[a-z]+(?:-[a-z]+)*)")
FAIRSEQ = re.compile(r"(?<![\w/.-])fairseq-(?!plugins-)([a-z]+(?:-[a-z]+)*)")
NOT_COMMANDS = {"multiscale-plugins"}  # the distribution's name (pip install fairseq-multiscale-plugins)
MODULE = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*\w)")
SCRIPT = re.compile(r"\bpython3?\s+(scripts/[\w/]+\.py)\b")
PATH = re.compile(r"(?<![\w/.-])((?:scripts|tests)/[\w/]+\.(?:py|sh))\b")


def documented(pattern: re.Pattern) -> Dict[str, List[str]]:
    """What ``pattern`` captures in the pages, with the pages that show it."""
    found: Dict[str, List[str]] = {}
    for page in PAGES:
        for match in pattern.finditer(page.read_text(encoding="utf-8")):
            pages = found.setdefault(match.group(1), [])
            if page.name not in pages:
                pages.append(page.name)
    return found


CONSOLE = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
OUR_COMMANDS = documented(OURS)
MODULES = documented(MODULE)
SCRIPTS = documented(SCRIPT)
FAIRSEQ_COMMANDS = {k: v for k, v in documented(FAIRSEQ).items() if k not in NOT_COMMANDS}
PATHS = documented(PATH)


def _launcher(command: str) -> List[str]:
    """Run a console command's entry point as pip's launcher would, with this checkout's code."""
    module, function = CONSOLE[command].split(":")
    return [sys.executable, "-c", f"import importlib, sys; sys.argv[0] = {command!r}; "
            f"sys.exit(importlib.import_module({module!r}).{function}())"]


def _is_ours(module: str) -> bool:
    return module.split(".")[0] in ("fairseq_plugins", "scripts")


HELP_RUNS: Dict[str, List[str]] = {
    **{command: _launcher(command) for command in OUR_COMMANDS if command in CONSOLE},
    **{module: [sys.executable, "-m", module] for module in MODULES if _is_ours(module)},
    **{script: [sys.executable, script] for script in SCRIPTS},
}


@pytest.fixture(scope="module")
def help_outputs() -> Dict[str, subprocess.CompletedProcess]:
    """Every documented command's --help, run side by side (most of the time is imports)."""

    def run(argv):
        return subprocess.run(argv + ["--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(HELP_RUNS, pool.map(run, HELP_RUNS.values())))


def assert_help(proc: subprocess.CompletedProcess, name: str, shown_in: List[str]) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "usage" in output.lower(), (
        f"{name} --help (shown in {', '.join(shown_in)}) failed with exit {proc.returncode}:\n" + output[-2000:])


def test_the_pages_show_commands_of_every_kind():
    """The extraction finds what the pages are known to show (a broken pattern finds nothing)."""
    assert {"fairseq-plugins-demo", "fairseq-plugins-install-fairseq", "fairseq-plugins-train"} <= set(OUR_COMMANDS)
    assert {"scripts.quality_study", "pytest"} <= set(MODULES)
    assert "scripts/readme_results.py" in SCRIPTS
    assert {"train", "generate", "preprocess", "interactive"} <= set(FAIRSEQ_COMMANDS)
    assert {"scripts/setup.sh", "scripts/demo.sh", "scripts/test.sh"} <= set(PATHS)


@pytest.mark.parametrize("command", sorted(OUR_COMMANDS))
@pytest.mark.cli
def test_console_command_answers_help(command, help_outputs):
    assert command in CONSOLE, (
        f"{command} (shown in {', '.join(OUR_COMMANDS[command])}) is not a console command of pyproject.toml: "
        f"{sorted(CONSOLE)}")
    assert_help(help_outputs[command], command, OUR_COMMANDS[command])


def test_every_console_command_resolves():
    """Each entry point of [project.scripts] names a function that exists (documented or not)."""
    for command, target in CONSOLE.items():
        module, function = target.split(":")
        assert callable(functools.reduce(getattr, function.split("."), importlib.import_module(module))), command


@pytest.mark.parametrize("module", sorted(MODULES))
@pytest.mark.cli
def test_python_module_answers_help(module, help_outputs):
    if not _is_ours(module):  # pytest, venv: only that they are there
        assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"
        return
    assert_help(help_outputs[module], f"python -m {module}", MODULES[module])


@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.cli
def test_python_script_answers_help(script, help_outputs):
    assert (ROOT / script).exists(), f"{script} (shown in {', '.join(SCRIPTS[script])}) does not exist"
    assert_help(help_outputs[script], f"python {script}", SCRIPTS[script])


def _fairseq_console_scripts() -> Dict[str, str]:
    try:
        distribution = importlib.metadata.distribution("fairseq")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fairseq is not installed")
    return {ep.name: ep.value for ep in distribution.entry_points if ep.group == "console_scripts"}


@pytest.mark.parametrize("command", sorted(FAIRSEQ_COMMANDS))
def test_fairseq_command_is_one_of_fairseqs(command):
    scripts = _fairseq_console_scripts()
    name = f"fairseq-{command}"
    assert name in scripts, f"{name} (shown in {', '.join(FAIRSEQ_COMMANDS[command])}) is not a fairseq command"
    assert importlib.util.find_spec(scripts[name].split(":")[0]) is not None, scripts[name]


def test_documented_paths_exist():
    missing: Set[str] = {f"{path} (shown in {', '.join(pages)})" for path, pages in PATHS.items()
                         if not (ROOT / path).exists()}
    assert not missing, sorted(missing)


def test_relative_links_point_at_files_that_exist():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", page.read_text(encoding="utf-8")):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                missing.append(f"{page.name}: {target}")
    assert not missing, missing
