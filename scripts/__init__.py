"""Reproduction scripts: data preparation, training from configs, evaluation, tables, demo.

Run them as modules from the repository root, e.g. ``python -m scripts.prepare_data``.
"""
