"""The graph attention op and its backends, one module per backend.

``graph_attention(q, k, v, graph, ...)`` (``registry``) is the one public function; the
``"torch"`` backend (``torch_backend``, with the tree fast path in ``torch_tree``) is the exact
reference, and ``cpu_backend``/``triton_backend``/``cuda_backend``/``flex_backend`` are
optional. A new backend is a module here that defines ``BACKEND`` (a ``registry.Backend``) and
is listed in ``registry.BACKEND_MODULES``; ``register_backend`` adds one to the op's dispatcher
(``registry.DEFAULT``) from anywhere.
"""

from fairseq_plugins.graph_attention.registry import graph_attention, register_backend
from fairseq_plugins.graph_attention.torch_backend import csr_attention, dense_graph_attention
from fairseq_plugins.graph_attention.torch_tree import tree_block_attention
from fairseq_plugins.graphs.attention_graph import AttentionGraph, TreeLayout

__all__ = ["AttentionGraph", "TreeLayout", "csr_attention", "dense_graph_attention", "graph_attention",
           "register_backend", "tree_block_attention"]
