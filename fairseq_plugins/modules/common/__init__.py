"""Pieces shared by the model families: attention head split/merge, length groups."""
