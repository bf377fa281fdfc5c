"""Benchmarks, studies and set-up helpers of a checkout; run them from the repository root,
e.g. ``python -m scripts.benchmark_models``. The commands users run are console commands of
the installed package (``fairseq_plugins.recipes``)."""
