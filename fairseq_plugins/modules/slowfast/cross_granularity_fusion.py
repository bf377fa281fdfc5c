"""Ways to exchange information between TranSFormer's slow (subword) and fast
(character) branches inside an encoder block (paper Sec. 3.3, Table 4b).

Every fusion module maps the receiving branch's layer-normalised states ``x``
(Lq x B x Cq) and the other branch's raw states ``context`` (Lc x B x Cc) to an update
of ``x``'s shape that the encoder layer adds residually. ``subword_ids`` (B x Lf, -1 at
padding) says which subword each fast unit comes from; the attention-based modules
ignore it.

* ``cga``: cross-granularity attention (Eq. 2): q = x Wq, k, v = LN(context) Wk / Wv
  with Wk, Wv in R^{Cc x Cq}; no output projection. When the context is narrower than
  a head the projections are applied on the query side instead (same result, cheaper).
* ``linear-attention``: LN(context) projected to Cq by a linear map, then fairseq's
  standard multi-head cross-attention.
* ``downsample-sum`` / ``downsample-concat``: the slow side receives the mean of its
  characters, the fast side the state of its subword, both projected to Cq; added to
  the projection (sum) or concatenated with ``x`` before it (concat).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fairseq.modules import LayerNorm, MultiheadAttention

from fairseq_plugins.modules.common.heads import merge_heads, split_heads

FUSION_METHODS = ("cga", "linear-attention", "downsample-sum", "downsample-concat")


class CrossGranularityAttention(nn.Module):
    def __init__(self, embed_dim: int, context_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim, self.dropout = num_heads, embed_dim // num_heads, dropout
        self.context_layer_norm = LayerNorm(context_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(context_dim, embed_dim, bias=False)  # a key bias cannot change a softmax over keys
        self.v_proj = nn.Linear(context_dim, embed_dim)

    def forward(self, x, context, context_padding_mask: Optional[torch.Tensor], subword_ids=None, reference=False):
        c = self.context_layer_norm(context)
        mask = None
        if context_padding_mask is not None:
            mask = ~context_padding_mask.view(context_padding_mask.size(0), 1, 1, -1)
        dropout = self.dropout if self.training else 0.0
        if reference or c.size(2) >= self.head_dim:
            q = split_heads(self.q_proj(x), self.num_heads)
            k, v = (split_heads(proj(c), self.num_heads) for proj in (self.k_proj, self.v_proj))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
            return merge_heads(out)
        return self._attend_in_context_width(x, c, mask, dropout)

    def _attend_in_context_width(self, x, c, mask, dropout):
        """The same attention when the context is narrower than a head (the slow branch
        reading the 32-wide fast one): q . (c Wk) = (q Wk) . c and
        softmax(.) (c Wv + bv) = (softmax(.) c) Wv + bv, so the head-wide projections run
        over the Ls queries instead of the ~5x longer character sequence. Wq and Wk are
        multiplied first (one Cs x (H Cc) map instead of Cs x Cs and a per-head matmul),
        and as every head attends over the same context, the heads' queries form one
        sequence of H Lq queries over a single-head context (no per-head copy of it)."""
        length, bsz, _ = x.shape
        heads, context_dim = self.num_heads, c.size(2)
        wq = self.q_proj.weight.view(heads, self.head_dim, -1)  # H x d x Cq
        wk = self.k_proj.weight.view(heads, self.head_dim, context_dim)  # H x d x Cc
        wqk = torch.einsum("hdi,hdc->hci", wq, wk).reshape(heads * context_dim, -1)
        bqk = torch.einsum("hd,hdc->hc", self.q_proj.bias.view(heads, self.head_dim), wk).reshape(-1)
        q_c = F.linear(x, wqk, bqk).transpose(0, 1).reshape(bsz, 1, length * heads, context_dim)
        c = c.transpose(0, 1).unsqueeze(1)  # B x 1 x Lc x Cc
        pooled = F.scaled_dot_product_attention(
            q_c, c, c, attn_mask=mask, dropout_p=dropout, scale=self.head_dim ** -0.5
        ).view(bsz, length, heads, context_dim)
        wv = self.v_proj.weight.view(heads, self.head_dim, context_dim)
        out = torch.einsum("blhc,hdc->lbhd", pooled, wv).reshape(length, bsz, -1)
        return out + self.v_proj.bias


class LinearProjectedCrossAttention(nn.Module):
    def __init__(self, embed_dim: int, context_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        self.context_layer_norm = LayerNorm(context_dim)
        self.context_proj = nn.Linear(context_dim, embed_dim)
        self.attention = MultiheadAttention(embed_dim, num_heads, dropout=dropout, encoder_decoder_attention=True)

    def forward(self, x, context, context_padding_mask: Optional[torch.Tensor], subword_ids=None):
        c = self.context_proj(self.context_layer_norm(context))
        out, _ = self.attention(query=x, key=c, value=c, key_padding_mask=context_padding_mask, need_weights=False)
        return out


def characters_to_subwords(fast: torch.Tensor, subword_ids: torch.Tensor, num_subwords: int) -> torch.Tensor:
    """Mean of each subword's fast units: B x Lf x C -> B x Ls x C (zero where a subword
    has none, e.g. padding)."""
    valid = subword_ids.ge(0)
    index = subword_ids.clamp(min=0)
    sums = fast.new_zeros(fast.size(0), num_subwords, fast.size(2)).scatter_add_(
        1, index.unsqueeze(2).expand_as(fast), fast * valid.unsqueeze(2).to(fast.dtype)
    )
    sizes = fast.new_zeros(fast.size(0), num_subwords).scatter_add_(1, index, valid.to(fast.dtype))
    return sums / sizes.clamp(min=1).unsqueeze(2)


def subwords_to_characters(slow: torch.Tensor, subword_ids: torch.Tensor) -> torch.Tensor:
    """Each fast unit gets its subword's state: B x Ls x C -> B x Lf x C (zero at padding)."""
    index = subword_ids.clamp(min=0).unsqueeze(2).expand(-1, -1, slow.size(2))
    return slow.gather(1, index) * subword_ids.ge(0).unsqueeze(2).to(slow.dtype)


class DownsampledFusion(nn.Module):
    def __init__(self, embed_dim: int, context_dim: int, to_slow: bool, concat: bool):
        super().__init__()
        self.to_slow, self.concat = to_slow, concat
        self.context_layer_norm = LayerNorm(context_dim)
        self.proj = nn.Linear(context_dim + (embed_dim if concat else 0), embed_dim)

    def forward(self, x, context, context_padding_mask: Optional[torch.Tensor], subword_ids=None):
        if subword_ids is None:
            raise ValueError("downsampling fusion needs the fast units' subword_ids")
        c = self.context_layer_norm(context).transpose(0, 1)
        if self.to_slow:
            resampled = characters_to_subwords(c, subword_ids, x.size(0))
        else:
            resampled = subwords_to_characters(c, subword_ids)
        resampled = resampled.transpose(0, 1)
        return self.proj(torch.cat([x, resampled], 2) if self.concat else resampled)


def build_fusion(
    method: str, embed_dim: int, context_dim: int, num_heads: int, dropout: float, to_slow: bool
) -> nn.Module:
    """The fusion sublayer of one branch (``to_slow``: the slow branch receives)."""
    if method == "cga":
        return CrossGranularityAttention(embed_dim, context_dim, num_heads, dropout)
    if method == "linear-attention":
        return LinearProjectedCrossAttention(embed_dim, context_dim, num_heads, dropout)
    if method in ("downsample-sum", "downsample-concat"):
        return DownsampledFusion(embed_dim, context_dim, to_slow, concat=method == "downsample-concat")
    raise ValueError(f"unknown fusion method {method!r}; choose from {', '.join(FUSION_METHODS)}")
