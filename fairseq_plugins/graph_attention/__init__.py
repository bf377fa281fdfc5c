"""The graph attention op and its backends, one module per backend.

``graph_attention(q, k, v, graph, ...)`` (``registry``) is the one public function; the
``"torch"`` backend (``torch_backend``, with the tree fast path in ``torch_tree``) is the exact
reference, and ``cuda_backend``/``flex_backend`` are optional. A new backend is a module here
that calls ``register_backend`` and is listed in ``registry.OPTIONAL_BACKENDS``.
"""

from fairseq_plugins.graph_attention.registry import graph_attention, register_backend
from fairseq_plugins.graph_attention.torch_backend import csr_attention, dense_graph_attention
from fairseq_plugins.graph_attention.torch_tree import tree_block_attention
from fairseq_plugins.graphs.attention_graph import AttentionGraph, TreeLayout

__all__ = ["AttentionGraph", "TreeLayout", "csr_attention", "dense_graph_attention", "graph_attention",
           "register_backend", "tree_block_attention"]
