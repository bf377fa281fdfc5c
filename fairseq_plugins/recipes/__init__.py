"""Reproducing the papers: data preparation, training and evaluation from experiment configs,
the results tables and the demo. Each module is one console command (``recipes.console``);
they drive fairseq's own command-line tools as separate processes."""
