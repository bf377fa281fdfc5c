"""The console commands of ``[project.scripts]``.

Each recipe's ``main(argv)`` returns its result (a path, a table, the scores) to callers in
Python; a console command must return an exit code instead, since ``sys.exit`` prints any other
object as an error. Each command here imports only its own recipe.

An environment that is half set up (``pip install .`` without ``fairseq-plugins-install-fairseq``,
or without an optional extra a recipe needs), or a machine without network, gets one line naming
what to do (a ``CommandError``), instead of a traceback from deep inside a recipe.
"""

import importlib
import sys
from typing import Callable, Sequence

from ..command_line import exit_code
from ..fairseq_fixes import require_fixed

_ANSWERED_WITHOUT_FAIRSEQ = {"-h", "--help", "--version"}


def one_line_errors(call: Callable[[], int], argv: Sequence[str]) -> int:
    """``call()``'s exit code; 1 and one line on stderr for a CommandError: the fixed fairseq or
    an optional extra missing, a download that failed (``--help`` and ``--version`` answer
    without fairseq)."""

    def checked() -> int:
        if not _ANSWERED_WITHOUT_FAIRSEQ & set(argv):
            require_fixed()
        return call()

    return exit_code(checked)


def _command(recipe: str) -> Callable[[], int]:
    def call() -> int:
        importlib.import_module(f"{__package__}.{recipe}").main()
        return 0

    def run() -> int:
        return one_line_errors(call, sys.argv[1:])

    run.__name__ = recipe
    run.__doc__ = f"Console command: ``{__package__}.{recipe}.main()``."
    return run

prepare_data = _command("prepare_data")
train = _command("train")
average_checkpoints = _command("average_checkpoints")
evaluate = _command("evaluate")
results_table = _command("results_table")
reproduce_table = _command("reproduce_table")
demo = _command("demo")


def build_kernels() -> int:
    """Console command: ``fairseq_plugins.graph_attention.build_kernels.main()``, with its exit code."""
    return one_line_errors(lambda: importlib.import_module("fairseq_plugins.graph_attention.build_kernels").main(),
                           sys.argv[1:])
