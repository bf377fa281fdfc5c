"""BPT and SegTree layers: self-attention over a binary-partition graph, and the encoder/decoder layers using it."""
