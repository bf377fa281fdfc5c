"""The layers of each model family, one subpackage per family, over the graph attention.

``common/`` holds what several families share (head split/merge, length groups); ``bpt/`` the
graph-attention layers of BPT and SegTree; ``slowfast/`` TranSFormer's branches and fusion;
``multiscale/`` the Multi-Scale Transformer's attention; ``document/`` document-level attention.
A new model family gets its own subpackage here; it may import ``common`` but no other family.
"""
