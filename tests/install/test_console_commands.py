"""Every ``fairseq-plugins-*`` command of pyproject.toml's ``[project.scripts]``, as a user meets it:
``--version``, ``--help`` in plain words with help for every option, and one line (no traceback)
naming the command to run when the environment is half set up."""

import argparse
import importlib
import os
import re
import subprocess
import sys
import tomllib

import pytest

import fairseq_plugins
from fairseq_plugins import command_line, fairseq_build, resources
from fairseq_plugins.recipes.data import text_processing
from fairseq_plugins.tasks import tagging_scores
from tests.cli import REPO

SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
RST = re.compile(r"``|:[a-z]+:`")


def _entry_point(name):
    module, function = SCRIPTS[name].split(":")
    return getattr(importlib.import_module(module), function)


def _run(name, args, monkeypatch, capsys):
    """(exit code, stdout, stderr) of the console command ``name`` run in this process."""
    monkeypatch.setattr(sys, "argv", [name, *args])
    try:
        code = _entry_point(name)()
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_version_names_the_plugin_fairseq_and_torch(name, monkeypatch, capsys):
    code, out, _ = _run(name, ["--version"], monkeypatch, capsys)
    assert code == 0
    assert out == command_line.version_text() + "\n"
    assert out.startswith(f"{resources.PROJECT} {fairseq_plugins.__version__} (fairseq ")
    assert ", torch " in out


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _assert_plain_help_for_every_option(call, monkeypatch, capsys):
    """``call()`` prints a --help: the parsers it builds are caught as they parse; each of their
    options (and those of subcommands) has a help text, and the help printed has no
    reStructuredText markup."""
    seen = []
    parse = argparse.ArgumentParser.parse_known_args

    def recording(self, *args, **kwargs):
        seen.append(self)
        return parse(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", recording)
    try:
        call()
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "--version" in out
    assert not RST.search(out), RST.search(out).group()
    undocumented = [(p.prog, a.dest) for parser in seen for p in _parsers(parser) for a in p._actions if a.help is None]
    assert not undocumented


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_is_plain_and_every_option_has_help(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    _assert_plain_help_for_every_option(_entry_point(name), monkeypatch, capsys)


# the commands run as python -m (check_gpu runs five; triton_aot and triton_budget are the Triton kernels' checks)
MODULES = ["fairseq_plugins.recipes.lm_study", "fairseq_plugins.check_gpu.lm_update",
           "fairseq_plugins.check_gpu.model_update", "fairseq_plugins.check_gpu.op_benchmark",
           "fairseq_plugins.check_gpu.headline", "fairseq_plugins.graph_attention.triton_aot",
           "fairseq_plugins.graph_attention.triton_budget"]


@pytest.mark.parametrize("module", MODULES)
def test_python_module_help_is_plain_and_every_option_has_help(module, monkeypatch, capsys):
    main = importlib.import_module(module).main
    _assert_plain_help_for_every_option(lambda: main(["--help"]), monkeypatch, capsys)


def test_plain_drops_roles_and_double_backquotes():
    assert command_line.plain("see :mod:`a.b` and ``--raw-dir`` or :func:`~x.y`") == "see a.b and --raw-dir or x.y"


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - {"fairseq-plugins-install-fairseq", "fairseq-plugins-fixes"}))
def test_without_fairseq_one_line_names_the_set_up(name):
    """Python without site-packages (so without fairseq) and this checkout on its path: each
    command that needs fairseq exits 1 with one line naming the command that installs it."""
    module, function = SCRIPTS[name].split(":")
    code = f"import sys; sys.argv = [{name!r}]; from {module} import {function}; sys.exit({function}())"
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"{name}: error: fairseq is not installed; run {resources.setup_command()} ")


def test_commands_named_for_a_clone_and_for_an_installed_wheel(monkeypatch, tmp_path):
    assert resources.in_clone()  # the tests run in a clone
    assert resources.setup_command() == f"bash {REPO / 'scripts' / 'setup.sh'}"
    assert resources.extra_command("zh") == f'pip install -e "{REPO}[zh]"'
    monkeypatch.setattr(resources, "PACKAGE_DIR", tmp_path / "site-packages" / "fairseq_plugins")
    assert not resources.in_clone()
    assert resources.setup_command() == "fairseq-plugins-install-fairseq"
    assert resources.extra_command("zh") == 'pip install "fairseq-multiscale-plugins[zh]"'


@pytest.mark.parametrize("module, extra, use", [
    ("jieba", "zh", lambda: text_processing.segment_chinese("中文句子", "jieba")),
    ("seqeval", "tagging", lambda: tagging_scores.span_counts([["B-PER"]], [["B-PER"]])),
])
def test_a_missing_extra_is_named_where_it_is_used(module, extra, use, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # what an environment without it does on import
    with pytest.raises(command_line.MissingExtra, match=rf"needs {module}, from the plugin's '{extra}' extra: "
                                                     rf"{re.escape(resources.extra_command(extra))}$"):
        use()


def test_the_demo_without_matplotlib_stops_before_training(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = _run("fairseq-plugins-demo", ["--out", str(tmp_path / "demo")], monkeypatch, capsys)
    assert code == 1 and not (tmp_path / "demo").exists()
    assert err == (f"fairseq-plugins-demo: error: the demo's plot (demo.png) needs matplotlib, from the plugin's "
                   f"'plots' extra: {resources.extra_command('plots')}\n")


def test_install_command_prepares_the_fixed_source(monkeypatch, capsys, tmp_path):
    """``fairseq-plugins-install-fairseq --prepare DIR``, which its --help offers (the sdist cached)."""
    code, out, _ = _run("fairseq-plugins-install-fairseq", ["--prepare", str(tmp_path)], monkeypatch, capsys)
    assert code == 0 and out.strip() == str(tmp_path / fairseq_build.SDIST_NAME[: -len(".tar.gz")])
    assert "+plugins." in (tmp_path / "fairseq-0.12.2" / "fairseq" / "version.txt").read_text()


def test_a_test_stopped_by_a_missing_extra_is_skipped_with_the_reason(tmp_path):
    """tests/conftest.py turns MissingExtra into a skip that says which extra to install."""
    (tmp_path / "test_needs_extra.py").write_text(
        "from fairseq_plugins.command_line import import_extra\n\n\n"
        "def test_it():\n    import_extra('no_such_module_here', 'zh', 'this feature')\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", "-rs", "-n", "0",
                           "-p", "no:cacheprovider", str(tmp_path / "test_needs_extra.py")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert "1 skipped" in proc.stdout, proc.stdout[-3000:]
    assert "this feature needs no_such_module_here, from the plugin's 'zh' extra" in proc.stdout


def test_install_command_without_network_ends_in_one_line(monkeypatch, capsys, tmp_path):
    """pip cannot download fairseq's sdist (pip told to use no index, as without network): after
    pip's own message, one line says what to do, no traceback."""
    monkeypatch.setenv("FAIRSEQ_PLUGINS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    code, _, err = _run("fairseq-plugins-install-fairseq", ["--prepare", str(tmp_path / "src")], monkeypatch, capsys)
    assert code == 1
    assert err.endswith(f"fairseq-plugins-install-fairseq: error: pip download exited with 1 (its message is "
                        f"above); without network, copy {fairseq_build.SDIST_NAME} from PyPI into "
                        f"{tmp_path / 'cache' / 'fairseq-build'}\n")
    assert "Traceback" not in err
