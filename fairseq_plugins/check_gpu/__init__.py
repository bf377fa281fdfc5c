"""Everything a GPU owner runs to verify this project's GPU code, in one command.

    fairseq-plugins-check-gpu [--out DIR] [--benchmark full|quick|headline|none]
    python -m fairseq_plugins.check_gpu [...]   # the same

``command`` plans and runs the steps (``runner``: one subprocess each, a timeout, a full
log, progress with the time left) and writes the report; ``gpu_tests`` holds the GPU test
modules it runs (through ``kernel_checks`` on the graphs of ``cases``); ``headline``,
``op_benchmark``, ``model_update`` and ``lm_update`` are its measurements, each also a
command of its own. Nothing is imported here at import time, so that
``python -m fairseq_plugins.check_gpu.<module>`` runs each module once.
"""


def main(argv=None) -> int:
    """The console command ``fairseq-plugins-check-gpu``: ``command.main``, with one line instead
    of a traceback when the environment lacks the fixed fairseq."""
    import sys

    from fairseq_plugins.recipes.console import one_line_errors

    def call() -> int:
        from fairseq_plugins.check_gpu.command import main as run  # after the check: it imports torch

        return run(argv)

    return one_line_errors(call, sys.argv[1:] if argv is None else argv)
