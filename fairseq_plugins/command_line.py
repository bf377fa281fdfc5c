"""What every ``fairseq-plugins-*`` command shares: ``--version`` (the plugin's, fairseq's and
torch's versions, the first thing to quote in a bug report), help texts in plain words (the
docstrings that serve as descriptions are written in reStructuredText for the API docs), and
``CommandError``: what a command reports in one line, naming the fix, instead of a traceback.

Imports neither fairseq nor torch: their versions come from the installed metadata, so
``--version`` answers, and says what is missing, in an environment that is half set up.
"""

import argparse
import importlib
import importlib.metadata
import os
import re
import sys
from typing import Callable

from . import __version__
from .resources import PROJECT, extra_command

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :mod:`x`, :func:`~x.y`


class CommandError(Exception):
    """A problem of the set-up or the input that the user fixes: the console commands print its
    one-line message (which names the fix) and exit 1."""


class MissingExtra(CommandError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def import_extra(module: str, extra: str, feature: str):
    """``module`` imported, or MissingExtra saying that ``feature`` needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0]:
            raise  # the module is there but one of its own imports is broken: show that
        raise MissingExtra(f"{feature} needs {e.name}, from the plugin's {extra!r} extra: "
                           f"{extra_command(extra)}") from None


def report(error: CommandError) -> None:
    """A CommandError as a command prints it: one line on stderr, after the command's name."""
    print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)


def exit_code(call: Callable[[], int]) -> int:
    """``call()``'s exit code, or 1 after printing a CommandError as one line on stderr."""
    try:
        return call()
    except CommandError as e:
        report(e)
        return 1


def print_command_errors_in_one_line() -> None:
    """Let a CommandError that nothing catches end the program as ``exit_code`` ends a command:
    its line, exit 1, no traceback. fairseq's own commands (fairseq-train, ...) load the plugin
    with --user-dir, and the plugin's refusals (a model option no model can take) reach the top
    there. Any other exception goes to the hook that was in place (its traceback is wanted)."""
    previous = sys.excepthook
    if getattr(previous, "prints_command_errors", False):
        return

    def hook(kind, error, traceback):
        if issubclass(kind, CommandError):
            report(error)
        else:
            previous(kind, error, traceback)

    hook.prints_command_errors = True
    sys.excepthook = hook


def plain(text: str) -> str:
    """``text`` without reStructuredText's inline markup: roles and double backquotes."""
    return _ROLE.sub(r"\1", text).replace("``", "")


def _installed(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def version_text() -> str:
    """One line: this plugin's version and those of the fairseq and torch it runs on."""
    python = ".".join(map(str, sys.version_info[:3]))
    return (f"{PROJECT} {__version__} (fairseq {_installed('fairseq')}, torch {_installed('torch')}, "
            f"Python {python})")


class _PlainFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks (its examples), drops its markup and that of option help."""

    def _format_text(self, text):
        return super()._format_text(plain(text))

    def _expand_help(self, action):
        return plain(super()._expand_help(action))


def command_parser(**kwargs) -> argparse.ArgumentParser:
    """An ``argparse.ArgumentParser`` (same arguments, but its own formatter: it keeps the
    description's line breaks) with ``--version`` and plain help texts."""
    parser = argparse.ArgumentParser(formatter_class=_PlainFormatter, **kwargs)
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the versions of this plugin, fairseq, torch and Python, then exit")
    return parser
