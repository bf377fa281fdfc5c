"""Corpus preparation: one module per corpus family on top of :mod:`.common`."""
