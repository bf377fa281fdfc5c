"""What every ``fairseq-plugins-*`` command's parser shares: ``--version`` (the plugin's, fairseq's
and torch's versions, the first thing to quote in a bug report) and help texts in plain words
(the docstrings that serve as descriptions are written in reStructuredText for the API docs).

Imports neither fairseq nor torch: their versions come from the installed metadata, so
``--version`` answers, and says what is missing, in an environment that is half set up.
"""

import argparse
import importlib.metadata
import re
import sys

from . import __version__
from .resources import PROJECT

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :mod:`x`, :func:`~x.y`


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
