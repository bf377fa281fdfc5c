"""Attention graphs, innermost layer (pure torch, no fairseq): the graph types and the tree builders.

``attention_graph`` defines ``AttentionGraph``/``TreeLayout``; ``binary_partition`` builds BPT
and SegTree graphs, ``strided`` the Sparse Transformer's fixed pattern. A new graph family is a
new builder module here, with a spec (``build``, ``present``, ``step_graph``,
``num_edge_types``) that ``modules/bpt/graph_transformer.graph_spec`` returns for its kind.
"""
