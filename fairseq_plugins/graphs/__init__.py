"""Graph builders for tree-structured sparse attention (BPT, SegTree)."""
