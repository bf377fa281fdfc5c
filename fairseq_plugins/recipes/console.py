"""The console commands of ``[project.scripts]``.

Each recipe's ``main(argv)`` returns its result (a path, a table, the scores) to callers in
Python; a console command must return an exit code instead, since ``sys.exit`` prints any other
object as an error. Each command here imports only its own recipe.
"""

import importlib
from typing import Callable


def _command(recipe: str) -> Callable[[], int]:
    def run() -> int:
        importlib.import_module(f"{__package__}.{recipe}").main()
        return 0

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
