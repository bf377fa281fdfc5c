"""Graph convolution over the units (subwords or characters) of one word.

TranSFormer's S-GCN and F-GCN (paper Eq. 1): ``relu(D^-1/2 (A + I) D^-1/2 x W)`` where
``A`` links the units of the same word. With self-loops every word is a clique, so each
unit of an n-unit word has degree n and the normalised propagation is the mean over the
word. :class:`WordGraph` builds the propagation once per batch for all layers of a
branch: for sentences up to ``DENSE_MAX_LENGTH`` units the dense normalised adjacency (one
batched matmul per layer, forward and backward, which a CPU runs far faster than the
scatter/gather of a per-word mean at these lengths), beyond it the O(L) per-word mean.
"""

from typing import Optional

import torch
from torch import nn

DENSE_MAX_LENGTH = 256


def normalized_word_adjacency(word_ids: torch.Tensor) -> torch.Tensor:
    """Dense ``D^-1/2 (A + I) D^-1/2`` (B x L x L) for ``word_ids`` (B x L, -1 = padding).

    The reference the fast path is tested against; padding rows and columns are zero.
    """
    valid = word_ids.ge(0)
    same_word = word_ids.unsqueeze(2).eq(word_ids.unsqueeze(1)) & valid.unsqueeze(2) & valid.unsqueeze(1)
    adjacency = same_word.to(torch.get_default_dtype())  # A + I: a unit is in its own word
    inv_sqrt_degree = adjacency.sum(2).clamp(min=1).rsqrt()
    return inv_sqrt_degree.unsqueeze(2) * adjacency * inv_sqrt_degree.unsqueeze(1)


def word_mean(x: torch.Tensor, word_ids: torch.Tensor) -> torch.Tensor:
    """``normalized_word_adjacency(word_ids) @ x`` for batch-first ``x`` (B x L x C),
    computed as the mean over each word; zero at padding."""
    if word_ids.shape != x.shape[:2]:
        raise ValueError(f"word_ids {tuple(word_ids.shape)} do not match x {tuple(x.shape)}")
    valid = word_ids.ge(0)
    index = word_ids.clamp(min=0)
    num_words = max(x.size(1), 1)  # word ids are below L: no host sync for the maximum
    masked = x * valid.unsqueeze(2).to(x.dtype)
    sums = x.new_zeros(x.size(0), num_words, x.size(2)).scatter_add_(
        1, index.unsqueeze(2).expand_as(x), masked
    )
    sizes = x.new_zeros(x.size(0), num_words).scatter_add_(1, index, valid.to(x.dtype))
    means = sums / sizes.clamp(min=1).unsqueeze(2)
    return means.gather(1, index.unsqueeze(2).expand_as(x)) * valid.unsqueeze(2).to(x.dtype)


class WordGraph:
    """``normalized_word_adjacency(word_ids) @ x`` for one batch (``word_ids`` B x L, -1 at
    padding), shared by the layers of a branch. ``dense``: use the dense adjacency
    (default: when L <= ``DENSE_MAX_LENGTH``) or the per-word mean."""

    def __init__(self, word_ids: torch.Tensor, dense: Optional[bool] = None):
        self.word_ids = word_ids
        if dense is None:
            dense = word_ids.size(1) <= DENSE_MAX_LENGTH
        self.adjacency = normalized_word_adjacency(word_ids) if dense else None

    def propagate(self, x: torch.Tensor) -> torch.Tensor:
        """x: B x L x C."""
        if self.adjacency is None:
            return word_mean(x, self.word_ids)
        if self.adjacency.dtype != x.dtype:
            self.adjacency = self.adjacency.to(x.dtype)
        return torch.bmm(self.adjacency, x)


class WordGraphConvolution(nn.Module):
    """``relu(D^-1/2 (A + I) D^-1/2 x W)`` for time-first ``x`` (T x B x C), as in
    fairseq's encoder layers, over the :class:`WordGraph` of the batch."""

    def __init__(self, embed_dim: int):
        super().__init__()
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, x: torch.Tensor, graph: WordGraph) -> torch.Tensor:
        return torch.relu(graph.propagate(self.proj(x).transpose(0, 1))).transpose(0, 1)
