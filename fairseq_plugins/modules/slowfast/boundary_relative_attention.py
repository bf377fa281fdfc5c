"""Self-attention with TranSFormer's boundary-wise relative positional encoding.

Shaw et al. (2018) relative positions restricted to a word (paper Sec. 3.2, Fig. 4):
character i sees a learned vector for character j only when both are in the same word
and |j - i| <= k (k = 3); every other pair gets the "no relation" vector, fixed at zero
(the paper's "masked"). The vector is added to the key and shared by the heads:
``score_ij = q_i . (k_j + r_type(i,j)) / sqrt(d)``.

Only the 2k + 1 diagonals around the main one can carry a relation, so the relations
are kept as a B x L x (2k + 1) band (:func:`boundary_band`) and the relative term as
``q @ R^T`` on that band, added in place to the 2k + 1 diagonals of the score matrix
(:class:`AddToDiagonals`): nothing L x L is built besides the scores themselves.
``reference=True`` computes the same scores with the dense B x L x L relation types of
:func:`boundary_relation_types` and an explicit B x H x L x L x d key tensor.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fairseq_plugins.modules.common.heads import merge_heads


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


def boundary_band(word_ids: torch.Tensor, window: int, restrict_to_word: bool = True) -> torch.Tensor:
    """B x L x (2 * window + 1) bool: ``[b, i, t]`` says whether unit i relates to unit
    ``i + t - window`` (the same relations as :func:`boundary_relation_types`, kept
    on the band where they can occur)."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    bsz, length = word_ids.shape
    padded = F.pad(word_ids, (window, window), value=-1)  # B x (L + 2w)
    others = padded.unfold(1, 2 * window + 1, 1)  # [b, i, t] = word of unit i + t - window
    related = others.ge(0) & word_ids.ge(0).unsqueeze(2)
    if restrict_to_word:
        related = related & others.eq(word_ids.unsqueeze(2))
    return related


def band_relation_types(band: torch.Tensor) -> torch.Tensor:
    """The dense B x L x L relation types of a band from :func:`boundary_band`."""
    bsz, length, width = band.shape
    window = (width - 1) // 2
    positions = torch.arange(length, device=band.device)
    offset = positions.view(1, -1) - positions.view(-1, 1) + window  # [i, j] = j - i + window
    inside = offset.ge(0) & offset.lt(width)
    related = band.gather(2, offset.clamp(0, width - 1).unsqueeze(0).expand(bsz, -1, -1)) & inside
    return torch.where(related, offset.unsqueeze(0), torch.full_like(offset, width).unsqueeze(0))


class AddToDiagonals(torch.autograd.Function):
    """``scores[..., i, i + t - w] += band[..., i, t]`` in place, for N x L x L scores and
    an N x L x (2w + 1) band: O(L w) work and memory where adding a dense bias would be
    O(L^2) (and gathering it O(L^2) again in the backward pass)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, band: torch.Tensor) -> torch.Tensor:
        window = (band.size(-1) - 1) // 2
        ctx.window = window
        for t in range(band.size(-1)):
            scores.diagonal(t - window, -2, -1).add_(band[..., AddToDiagonals.rows(t - window, band.size(-2)), t])
        ctx.mark_dirty(scores)
        return scores

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_band = grad.new_zeros(*grad.shape[:-1], 2 * ctx.window + 1)
        for t in range(grad_band.size(-1)):
            offset = t - ctx.window
            grad_band[..., AddToDiagonals.rows(offset, grad.size(-1)), t] = grad.diagonal(offset, -2, -1)
        return grad, grad_band

    @staticmethod
    def rows(offset: int, length: int) -> slice:
        """The rows i with i + offset inside 0..length-1 (the diagonal ``offset``)."""
        return slice(min(max(0, -offset), length), max(0, length - max(0, offset)))


class BoundaryRelativeSelfAttention(nn.Module):
    """Multi-head self-attention with a relative key table (one vector per relation type,
    shared by heads). Own module rather than the tree relative-position table of the
    BP-Transformer code because the relation here is a band of a dense attention, not a
    per-edge table of a sparse graph.

    ``forward(x, key_padding_mask, band)``: x is T x B x C (fairseq layout), ``band``
    B x T x (2k + 1) from :func:`boundary_band`. ``window=None`` builds no table: plain
    attention (the "w/o boundary-wise PE" ablation). q, k and v are computed by one
    matmul with the three projections stacked (the fast branch is narrow: one 3C-wide
    matmul costs about what one C-wide does).
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

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor],
        band: Optional[torch.Tensor],
        reference: bool = False,
    ) -> torch.Tensor:
        length, bsz, _ = x.shape
        if (band is None) != (self.relative_keys is None):
            raise ValueError("band must be given exactly when the module has a relative key table")
        if band is not None and band.shape != (bsz, length, 2 * self.window + 1):
            raise ValueError(f"band {tuple(band.shape)} does not match {(bsz, length, 2 * self.window + 1)}")
        projections = (self.q_proj, self.k_proj, self.v_proj)
        qkv = F.linear(x, torch.cat([p.weight for p in projections]), torch.cat([p.bias for p in projections]))
        qkv = qkv.view(length, bsz, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)  # B x H x L x d each
        dropout = self.dropout if self.training else 0.0
        if band is None:
            mask = None if key_padding_mask is None else ~key_padding_mask.view(bsz, 1, 1, length)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        elif reference:
            out = self._reference_attention(q, k, v, key_padding_mask, band_relation_types(band), dropout)
        else:
            out = self._banded_attention(q, k, v, key_padding_mask, band, dropout)
        return self.out_proj(merge_heads(out))

    def _banded_attention(self, q, k, v, key_padding_mask, band, dropout):
        bsz, heads, length, _ = q.shape
        q = q * self.head_dim ** -0.5
        # the relation-type rows of the table (the last one, "no relation", is zero)
        relative = torch.matmul(q, self.relative_keys.weight[: band.size(2)].t())  # B x H x L x (2k+1)
        relative = relative * band.unsqueeze(1).to(q.dtype)
        mask = q.new_zeros(bsz, 1, length)
        if key_padding_mask is not None:
            mask = mask.masked_fill(key_padding_mask.view(bsz, 1, length), float("-inf"))
        mask = mask.unsqueeze(1).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, length)
        flat = (bsz * heads, length, -1)
        scores = torch.baddbmm(mask, q.reshape(flat), k.reshape(flat).transpose(1, 2))
        scores = AddToDiagonals.apply(scores, relative.reshape(flat))
        probs = F.dropout(torch.softmax(scores, -1), dropout, training=dropout > 0)
        return torch.bmm(probs, v.reshape(flat)).view(bsz, heads, length, -1)

    def _reference_attention(self, q, k, v, key_padding_mask, relation_types, dropout):
        bsz, _, length, _ = q.shape
        bias = q.new_zeros(bsz, 1, length, length)
        if key_padding_mask is not None:
            bias = bias.masked_fill(key_padding_mask.view(bsz, 1, 1, length), float("-inf"))
        rel = self.relative_keys(relation_types).unsqueeze(1)  # B x 1 x L x L x d
        rel = rel.expand(-1, self.num_heads, -1, -1, -1)
        bias = bias + torch.einsum("bhid,bhijd->bhij", q, rel) / self.head_dim ** 0.5
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout)
