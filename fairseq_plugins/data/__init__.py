"""Datasets of the plugin (document-level samples). Importing this package must not import fairseq."""
