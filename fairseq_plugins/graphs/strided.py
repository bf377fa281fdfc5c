"""The Sparse Transformer's fixed attention pattern (Child et al., 2019) as an ``AttentionGraph``.

BPT Figure 5's second baseline. Causal only (as the original's ``OpenAISparse``, which asserts
``triu``): with a stride ``s`` and ``c`` summary positions, token i attends to

* its own block: every token j with j // s == i // s and j <= i;
* the summaries of the earlier blocks: the last ``c`` tokens of each block before its own.

This is the "fixed" pattern of Child et al. (their A(1) and A(2)) as yzh119/BPT builds it
(``graph_builder/builder.pyx``, ``OpenAISparse``); that builder also links every token to an
extra readout node, which a language model never reads, so the graph has token nodes only.

All edges have one type: the graph carries no relative positions (the original's
``rel_pos: False``); a single relative key shifts every score of a query equally, so it changes
no attention weight. Token order comes from absolute positions on the token embeddings.
"""

import functools
from dataclasses import dataclass

import torch

from fairseq_plugins.graphs.attention_graph import AttentionGraph

# BPT Sec. 4.2: "the default setting described in the paper (c = 8, stride = 128)"
DEFAULT_STRIDE, DEFAULT_SUMMARY = 128, 8


def check_pattern(stride: int, summary: int) -> None:
    """One-line errors for patterns that cannot exist."""
    if stride < 1:
        raise ValueError(f"--sparse-stride must be >= 1, got {stride}")
    if not 1 <= summary <= stride:
        raise ValueError(f"--sparse-summary must be in [1, --sparse-stride = {stride}], got {summary}")


def strided_keys(t: int, stride: int, summary: int) -> torch.Tensor:
    """The keys of token t, increasing: earlier blocks' summaries, then its block up to t."""
    block = t // stride
    summaries = (torch.arange(block).unsqueeze(1) * stride + torch.arange(stride - summary, stride)).flatten()
    return torch.cat([summaries, torch.arange(block * stride, t + 1)])


@functools.lru_cache(maxsize=256)
def strided_graph(n: int, stride: int, summary: int) -> AttentionGraph:
    """The causal fixed pattern over n tokens (cached per arguments)."""
    if n < 1:
        raise ValueError(f"a graph needs at least one token, got length {n}")
    check_pattern(stride, summary)
    keys = [strided_keys(t, stride, summary) for t in range(n)]
    counts = torch.tensor([k.numel() for k in keys])
    indices = torch.cat(keys)
    return AttentionGraph(num_nodes=n, indptr=torch.cat([counts.new_zeros(1), counts.cumsum(0)]),
                          indices=indices, edge_type=torch.zeros_like(indices), num_edge_types=1)


@dataclass(frozen=True)
class StridedGraphSpec:
    """What a graph decoder asks of its graph (as ``binary_partition.TreeGraphSpec``): the
    full-sequence graph, which of its nodes a sentence has, and a decoding step's graph."""

    stride: int
    summary: int
    causal: bool = True

    def __post_init__(self):
        if not self.causal:
            raise ValueError("the Sparse Transformer's fixed pattern is causal only (a decoder, not an encoder)")
        check_pattern(self.stride, self.summary)

    @property
    def num_edge_types(self) -> int:
        return 1

    def build(self, n: int) -> AttentionGraph:
        return strided_graph(n, self.stride, self.summary)

    def present(self, lengths: torch.Tensor, padded_length: int) -> torch.Tensor:
        """[B, N] bool: the nodes are the tokens, present up to each sentence's length."""
        return torch.arange(padded_length) < lengths.long().cpu().unsqueeze(1)

    def step_graph(self, t: int) -> AttentionGraph:
        """Decoding step t: token t's row over the cache of tokens 0..t (cache slot = position)."""
        keys = strided_keys(t, self.stride, self.summary)
        return AttentionGraph(num_nodes=1, indptr=torch.tensor([0, keys.numel()]), indices=keys,
                              edge_type=torch.zeros_like(keys), num_edge_types=1, num_keys=t + 1)
