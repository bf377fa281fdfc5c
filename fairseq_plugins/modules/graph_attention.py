"""The graph attention's former import path, kept for users' code: see ``fairseq_plugins.graph_attention``."""

from fairseq_plugins.graph_attention import (  # noqa: F401
    AttentionGraph, TreeLayout, csr_attention, dense_graph_attention, graph_attention, register_backend,
)
