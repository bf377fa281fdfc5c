"""Linformer self-attention (Wang et al., 2020) for TranSFormer's fast branch (Table 5 #6).

The paper's ablation replaces the fast branch's attention by "linear attention (Wang et
al., 2020)", i.e. Linformer: keys and values are projected along the sequence axis,
from the n positions to k, by learned matrices E, F in R^{k x n}:
``softmax(Q (E K)^T / sqrt(d)) (F V)``, O(n k) instead of O(n^2). The paper gives no k;
E and F are per layer and shared by the heads (Linformer's "headwise sharing").

A sentence of L < n units uses the first L columns of E and F (counted from its first
unit, whichever side the batch is padded on) and its padded keys and values are left
out, so its output does not depend on the rest of the batch. Linformer's keys
are mixtures of positions, so there is no pairwise position for the boundary-wise
relative encoding: this attention has none (the F-GCN still sees the word boundaries).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fairseq_plugins.modules.common.heads import merge_heads, split_heads


class LinformerSelfAttention(nn.Module):
    """``forward(x, key_padding_mask, band=None)`` with x T x B x C (fairseq layout),
    like :class:`BoundaryRelativeSelfAttention`; ``band`` must be None.

    Args:
        projected_length: k, the number of projected keys and values.
        max_length: n, the longest sequence the projections cover.
    """

    def __init__(self, embed_dim: int, num_heads: int, projected_length: int, max_length: int, dropout: float = 0.0):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        if projected_length < 1 or max_length < 1:
            raise ValueError(f"projected length {projected_length} and max length {max_length} must be positive")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.max_length, self.dropout = max_length, dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.key_compression = nn.Parameter(torch.empty(projected_length, max_length))  # E
        self.value_compression = nn.Parameter(torch.empty(projected_length, max_length))  # F
        nn.init.xavier_uniform_(self.key_compression)
        nn.init.xavier_uniform_(self.value_compression)

    @staticmethod
    def _compress(x: torch.Tensor, projection: torch.Tensor, positions: torch.Tensor, real: torch.Tensor):
        """T x B x C -> k x B x C along the sequence: column ``positions[t, b]`` of the
        projection for unit t of sentence b, padding (``real`` False) left out."""
        columns = projection[:, positions] * real.unsqueeze(0).to(x.dtype)  # k x T x B
        return torch.einsum("ktb,tbc->kbc", columns.to(x.dtype), x)

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor], band=None) -> torch.Tensor:
        length, bsz, _ = x.shape
        if band is not None:
            raise ValueError("Linformer attention has no relative positions: band must be None")
        if length > self.max_length:
            raise ValueError(
                f"a fast-branch sequence of {length} units is longer than the Linformer projections "
                f"({self.max_length}): raise --fast-linear-attention-max-length"
            )
        real = x.new_ones(length, bsz, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask.t()
        positions = (torch.cumsum(real.long(), 0) - 1).clamp(min=0)  # T x B, from each sentence's start
        q = split_heads(self.q_proj(x), self.num_heads)
        k = split_heads(self._compress(self.k_proj(x), self.key_compression, positions, real), self.num_heads)
        v = split_heads(self._compress(self.v_proj(x), self.value_compression, positions, real), self.num_heads)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(merge_heads(out))
