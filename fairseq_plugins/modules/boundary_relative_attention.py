"""Self-attention with TranSFormer's boundary-wise relative positional encoding.

Shaw et al. (2018) relative positions restricted to a word (paper Sec. 3.2, Fig. 4):
character i sees a learned vector for character j only when both are in the same word
and |j - i| <= k (k = 3); every other pair gets the "no relation" vector, fixed at zero
(the paper's "masked"). The vector is added to the key and shared by the heads:
``score_ij = q_i . (k_j + r_type(i,j)) / sqrt(d)``.

The per-pair term is computed as ``q @ R^T`` (one column per relation type) followed by
a gather with the B x L x L type index, and handed to
``F.scaled_dot_product_attention`` as an additive bias; ``reference=True`` computes the
same scores with an explicit B x H x L x L x d key tensor.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def boundary_relation_types(word_ids: torch.Tensor, window: int, restrict_to_word: bool = True) -> torch.Tensor:
    """B x L x L relation types: ``j - i + window`` for pairs within ``window`` (and in
    the same word when ``restrict_to_word``), else ``2 * window + 1`` (no relation).
    ``word_ids`` is B x L with -1 at padding; padding pairs get no relation."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    length = word_ids.size(1)
    positions = torch.arange(length, device=word_ids.device)
    distance = positions.view(1, -1) - positions.view(-1, 1)  # [i, j] = j - i
    related = distance.abs().le(window).unsqueeze(0)
    valid = word_ids.ge(0)
    related = related & valid.unsqueeze(2) & valid.unsqueeze(1)
    if restrict_to_word:
        related = related & word_ids.unsqueeze(2).eq(word_ids.unsqueeze(1))
    none = 2 * window + 1
    return torch.where(related, (distance + window).unsqueeze(0), torch.full_like(related, none, dtype=torch.long))


class BoundaryRelativeSelfAttention(nn.Module):
    """Multi-head self-attention with a relative key table (one vector per relation type,
    shared by heads). Own module rather than the tree relative-position table of the
    BP-Transformer code because the relation here is a dense L x L type map fed to a
    fused attention kernel, not a per-edge table of a sparse graph.

    ``forward(x, key_padding_mask, relation_types)``: x is T x B x C (fairseq layout),
    ``relation_types`` B x T x T from :func:`boundary_relation_types`. ``window=None``
    builds no table: plain attention (the "w/o boundary-wise PE" ablation).
    """

    def __init__(self, embed_dim: int, num_heads: int, window: Optional[int] = 3, dropout: float = 0.0):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.window = embed_dim, num_heads, window
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.relative_keys = None
        if window is not None:
            no_relation = 2 * window + 1
            self.relative_keys = nn.Embedding(2 * window + 2, self.head_dim, padding_idx=no_relation)
            nn.init.normal_(self.relative_keys.weight, std=self.head_dim ** -0.5)
            with torch.no_grad():
                self.relative_keys.weight[no_relation].zero_()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        length, bsz, _ = x.shape
        return x.reshape(length, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor],
        relation_types: Optional[torch.Tensor],
        reference: bool = False,
    ) -> torch.Tensor:
        length, bsz, _ = x.shape
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        bias = x.new_zeros(bsz, 1, length, length)
        if key_padding_mask is not None:
            bias = bias.masked_fill(key_padding_mask.view(bsz, 1, 1, length), float("-inf"))
        if (relation_types is None) != (self.relative_keys is None):
            raise ValueError("relation_types must be given exactly when the module has a relative key table")
        if relation_types is not None:
            if relation_types.shape != (bsz, length, length):
                raise ValueError(
                    f"relation_types {tuple(relation_types.shape)} do not match {(bsz, length, length)}"
                )
            if reference:
                rel = self.relative_keys(relation_types).unsqueeze(1)  # B x 1 x L x L x d
                bias = bias + torch.einsum("bhid,bhijd->bhij", q, rel.expand(-1, self.num_heads, -1, -1, -1)) / self.head_dim ** 0.5
            else:
                per_type = torch.matmul(q, self.relative_keys.weight.t())  # B x H x L x types
                index = relation_types.unsqueeze(1).expand(-1, self.num_heads, -1, -1)
                bias = bias + per_type.gather(3, index) / self.head_dim ** 0.5
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out_proj(out.permute(2, 0, 1, 3).reshape(length, bsz, self.embed_dim))
