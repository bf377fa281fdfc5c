"""Everything a GPU owner runs to verify this project's GPU code, in one command.

    python -m fairseq_plugins.check_gpu [--out DIR] [--benchmark full|quick|none]

``command`` plans and runs the steps (``runner``: one subprocess each, a timeout, a full
log, progress with the time left) and writes the report; ``gpu_tests`` holds the GPU test
modules it runs (through ``kernel_checks`` on the graphs of ``cases``); ``op_benchmark`` and
``model_update`` are its measurements, each also a command of its own. Nothing is imported
here, so that ``python -m fairseq_plugins.check_gpu.<module>`` runs each module once.
"""
