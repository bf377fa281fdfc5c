"""The ``cli`` and ``gpu`` marks (registered in pyproject.toml), given so that none is missed.

- ``cli``: the test starts a fairseq-* or fairseq-plugins-* command, its ``python -m`` module
  or a script of ``scripts/`` in a subprocess. A test whose code or fixtures reach
  ``tests.cli.run_cli`` (through any helper of the ``tests`` package) gets it here; a test that
  starts a command another way is marked in its module. A test that starts such a command
  without the mark fails at that command, naming it: ``-m "not cli"`` never runs one.
- ``gpu``: the test needs a CUDA GPU; it is skipped without one.

Loaded by tests/conftest.py as a plugin (``pytest_plugins``).
"""

import os
import shlex
import sys
import types
from pathlib import Path
from typing import Optional

import pytest
import torch

from tests import cli

_MODULES = ("fairseq_cli", "fairseq_plugins", "scripts")  # `python -m` of these runs a command
_running: Optional[pytest.Item] = None  # the test running in this process


def command_name(args) -> Optional[str]:
    """The command a subprocess's argv runs when it is one that needs ``cli``, else None."""
    if isinstance(args, (str, bytes, os.PathLike)):
        argv = shlex.split(os.fsdecode(args))
    else:
        argv = [os.fsdecode(a) for a in args]
    if not argv:
        return None
    name = Path(argv[0]).name
    if name.startswith("fairseq-"):
        return name
    if "-m" in argv[1:-1] and argv[argv.index("-m") + 1].split(".")[0] in _MODULES:
        return "python -m " + argv[argv.index("-m") + 1]
    if name in ("bash", "sh") and len(argv) > 1 and argv[1].startswith("scripts/"):
        return f"{name} {argv[1]}"
    return None


class UnmarkedCommand(Exception):
    """A test without the ``cli`` mark started a command (raised where it starts)."""


def _audit(event: str, args) -> None:
    if event != "subprocess.Popen" or _running is None or _running.get_closest_marker("cli"):
        return
    name = command_name(args[1])
    if name is not None:
        message = (f"{_running.nodeid} runs `{name}` in a subprocess without the `cli` mark: mark it "
                   f"(@pytest.mark.cli or the module's pytestmark, tests/markers.py)")
        _running.stash[_UNMARKED] = message  # the test fails even if the code under test catches this
        raise UnmarkedCommand(message)


_UNMARKED = pytest.StashKey[str]()
sys.addaudithook(_audit)


def _reaches(obj, target, seen: set) -> bool:
    """Whether function ``obj`` (or the test functions and classes it names, of the ``tests``
    package or a test module) names ``target``."""
    if obj is target:
        return True
    obj = getattr(obj, "__func__", obj)
    obj = getattr(obj, "__wrapped__", obj)
    if id(obj) in seen or not getattr(obj, "__module__", "").startswith(("tests", "test_", "conftest")):
        return False
    seen.add(id(obj))
    if isinstance(obj, type):
        return any(_reaches(member, target, seen) for member in vars(obj).values() if callable(member))
    code = getattr(obj, "__code__", None)
    if code is None:
        return False
    names, codes = set(), [code]
    while codes:
        current = codes.pop()
        names.update(current.co_names)
        codes.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    scope = obj.__globals__
    for name in names:
        value = scope.get(name)
        if isinstance(value, types.ModuleType) and value.__name__.startswith("tests"):
            if any(_reaches(getattr(value, n, None), target, seen) for n in names):
                return True
        elif value is not None and _reaches(value, target, seen):
            return True
    return False


def runs_cli(item: pytest.Item) -> bool:
    """Whether the test function or a fixture it uses reaches ``tests.cli.run_cli``."""
    functions = [getattr(item, "obj", None)]
    fixtures = getattr(item, "_fixtureinfo", None)
    if fixtures is not None:
        functions += [defs[-1].func for defs in fixtures.name2fixturedefs.values()]
    return any(f is not None and _reaches(f, cli.run_cli, set()) for f in functions)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU") if not torch.cuda.is_available() else None
    for item in items:
        if item.get_closest_marker("cli") is None and runs_cli(item):
            item.add_marker(pytest.mark.cli)
        if no_gpu is not None and item.get_closest_marker("gpu") is not None:
            item.add_marker(no_gpu)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    global _running
    _running = item
    try:
        return (yield)
    finally:
        _running = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """The phase (setup, call, teardown) in which a test started a command unmarked fails."""
    report = yield
    message = item.stash.get(_UNMARKED, None)
    if message is not None:
        del item.stash[_UNMARKED]
        report.outcome, report.longrepr = "failed", message
    return report
