"""Attention graphs, innermost layer (pure torch, no fairseq): the graph types and the tree builders.

``attention_graph`` defines ``AttentionGraph``/``TreeLayout``; ``binary_partition`` builds BPT
and SegTree graphs. A new graph family is a new builder module here.
"""
