"""Graph convolution over the units (subwords or characters) of one word.

TranSFormer's S-GCN and F-GCN (paper Eq. 1): ``relu(D^-1/2 (A + I) D^-1/2 x W)`` where
``A`` links the units of the same word. With self-loops every word is a clique, so each
unit of an n-unit word has degree n and the normalised propagation is the mean over the
word: the fast path computes that with one scatter-add, O(L) instead of the O(L^2)
dense adjacency of the reference path.
"""

import torch
from torch import nn


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
    num_words = int(index.max()) + 1 if index.numel() else 1
    masked = x * valid.unsqueeze(2).to(x.dtype)
    sums = x.new_zeros(x.size(0), num_words, x.size(2)).scatter_add_(
        1, index.unsqueeze(2).expand_as(x), masked
    )
    sizes = x.new_zeros(x.size(0), num_words).scatter_add_(1, index, valid.to(x.dtype))
    means = sums / sizes.clamp(min=1).unsqueeze(2)
    return means.gather(1, index.unsqueeze(2).expand_as(x)) * valid.unsqueeze(2).to(x.dtype)


class WordGraphConvolution(nn.Module):
    """``relu(D^-1/2 (A + I) D^-1/2 x W)`` for time-first ``x`` (T x B x C), as in
    fairseq's encoder layers; ``word_ids`` is B x T with -1 at padding."""

    def __init__(self, embed_dim: int):
        super().__init__()
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, x: torch.Tensor, word_ids: torch.Tensor, reference: bool = False) -> torch.Tensor:
        h = self.proj(x).transpose(0, 1)
        if reference:
            h = torch.bmm(normalized_word_adjacency(word_ids).to(h.dtype), h)
        else:
            h = word_mean(h, word_ids)
        return torch.relu(h).transpose(0, 1)
