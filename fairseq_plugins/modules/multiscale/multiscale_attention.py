"""Multi-scale multi-head self-attention (Guo et al., 2019, "Multi-Scale Self-Attention
for Text Classification", Eq. 6-9).

Every head ``h`` sees only a window of odd width ``omega_h`` around the query.  A width is
a constant (``3``), a fraction of the sentence length (``N/8``) or the whole sentence
(``all``).  Fractions are resolved per sentence from its number of non-padding tokens, so
padding never changes a result.  In the causal variant (decoder) a query sees the left
half of its window, itself included, and ``N`` is the number of tokens visible so far, so
that teacher-forced training and step-by-step decoding compute the same thing.

Two implementations share one mask definition (:func:`window_allowed`):

* :func:`multiscale_attention` -- the fast path.  Queries are cut into blocks; a block
  attends to a strided ``unfold`` view of the keys it can reach (block + window), giving
  one dense ``[block x (block + 2r)]`` score matrix per block: memory and work are
  O(n * (block + omega)) per head instead of O(n^2).  Heads of similar window size are
  batched into one call.
* :func:`multiscale_attention_reference` -- dense scores with an ``n x n`` mask; the
  ground truth in tests and the path that returns attention weights.

:class:`MultiScaleSelfAttention` wraps the op behind the call interface of fairseq's
:class:`~fairseq.modules.MultiheadAttention` (which it subclasses for the projections,
initialisation and incremental-state buffer), so fairseq's layers use it unchanged.
"""

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules import MultiheadAttention
from torch import Tensor

from fairseq_plugins.modules.common.heads import merge_heads, split_heads


@dataclass(frozen=True)
class Scale:
    """The window of one head: ``width`` (odd constant), ``divisor`` (width N/divisor) or
    neither (the whole sentence)."""

    width: Optional[int] = None
    divisor: Optional[int] = None

    @classmethod
    def parse(cls, text: str) -> "Scale":
        """``"3"`` -> width 3, ``"N/8"`` -> N/8, ``"N"`` -> N/1, ``"all"`` -> whole sentence."""
        token = text.strip()
        if token == "all":
            return cls()
        if re.fullmatch(r"\d+", token):
            width = int(token)
            if width % 2 == 0:
                raise ValueError(f"window width must be odd, got {token!r}")
            return cls(width=width)
        match = re.fullmatch(r"N(?:/(\d+))?", token)
        if match:
            divisor = int(match.group(1) or 1)
            if divisor == 0:
                raise ValueError(f"window N/0 is undefined: {token!r}")
            return cls(divisor=divisor)
        raise ValueError(
            f"cannot parse window {token!r}: expected an odd integer, 'N', 'N/<int>' or 'all'"
        )

    def __str__(self) -> str:
        if self.width is not None:
            return str(self.width)
        if self.divisor is not None:
            return "N" if self.divisor == 1 else f"N/{self.divisor}"
        return "all"

    def radius(self, lengths: Tensor) -> Tensor:
        """Half-width r (window = 2r + 1) for sentences of ``lengths`` tokens.

        ``N/k`` is rounded to the nearest odd width, ties upwards: r = floor(N / 2k).
        """
        if self.width is not None:
            return torch.full_like(lengths, (self.width - 1) // 2)
        if self.divisor is not None:
            return torch.div(lengths, 2 * self.divisor, rounding_mode="floor")
        return lengths.clone()


def parse_scales(text: str) -> List[Scale]:
    """Comma-separated per-head scales, e.g. ``"1,1,3,N/16,all"``."""
    return [Scale.parse(token) for token in text.split(",")]


def window_radii(
    scales: Sequence[Scale],
    key_padding_mask: Tensor,
    num_queries: int,
    causal: bool,
) -> Tensor:
    """Per-query half-widths ``[B, H, Tq]`` for queries at the last ``num_queries`` key
    positions.  ``N`` counts the sentence's non-padding tokens (causal: those up to and
    including the query)."""
    real = (~key_padding_mask).long()
    if causal:
        lengths = real.cumsum(dim=1)[:, -num_queries:]
    else:
        lengths = real.sum(dim=1, keepdim=True).expand(-1, num_queries)
    return torch.stack([scale.radius(lengths) for scale in scales], dim=1)


def window_allowed(
    radii: Tensor, offsets: Tensor, key_padding_mask: Tensor, causal: bool
) -> Tensor:
    """The mask both paths share: key allowed iff -r <= key - query <= r (causal: <= 0) and
    the key is not padding.  ``radii`` ``[..., Tq, 1]``, ``offsets`` key - query
    ``[Tq, S]``, ``key_padding_mask`` broadcastable to ``[..., Tq, S]``."""
    upper = torch.zeros_like(radii) if causal else radii
    return (offsets >= -radii) & (offsets <= upper) & ~key_padding_mask


def _masked_softmax(scores: Tensor, allowed: Tensor) -> Tensor:
    """Softmax over allowed keys; a row with no allowed key gives zeros (not NaN), so a
    padding query far from every real token cannot poison gradients."""
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    return probs * allowed.any(dim=-1, keepdim=True)


def _default_padding(k: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    if key_padding_mask is None:
        return k.new_zeros(k.shape[0], k.shape[2], dtype=torch.bool)
    if key_padding_mask.shape != (k.shape[0], k.shape[2]):
        raise ValueError(
            f"key_padding_mask must be [batch, keys] = {(k.shape[0], k.shape[2])}, "
            f"got {tuple(key_padding_mask.shape)}"
        )
    return key_padding_mask.to(torch.bool)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, scales: Sequence[Scale]) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"expected q [B, H, Tq, d] and k, v [B, H, Tk, d]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] != len(scales):
        raise ValueError(f"{q.shape[1]} heads but {len(scales)} scales")
    if q.shape[2] > k.shape[2]:
        raise ValueError("queries must be the last Tq of the Tk key positions")


def multiscale_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scales: Sequence[Scale],
    key_padding_mask: Optional[Tensor] = None,
    causal: bool = False,
    dropout_p: float = 0.0,
) -> Tuple[Tensor, Tensor]:
    """Dense masked multi-scale attention: returns (output ``[B, H, Tq, d]``, weights
    ``[B, H, Tq, Tk]``).  Same arguments as :func:`multiscale_attention`."""
    _check_inputs(q, k, v, scales)
    padding = _default_padding(k, key_padding_mask)
    num_queries, num_keys = q.shape[2], k.shape[2]
    radii = window_radii(scales, padding, num_queries, causal)
    key_pos = torch.arange(num_keys, device=q.device)
    offsets = key_pos[None, :] - key_pos[num_keys - num_queries :, None]
    allowed = window_allowed(radii[..., None], offsets, padding[:, None, None, :], causal)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = _masked_softmax(scores, allowed)
    return torch.matmul(F.dropout(probs, p=dropout_p), v), probs


def _key_window(x: Tensor, start: int, end: int, dim: int, fill) -> Tensor:
    """``x`` sliced to positions [start, end) along ``dim``, filled with ``fill`` where the
    range runs past either end."""
    shape = list(x.shape)
    shape[dim] = end - start
    out = x.new_full(shape, fill)
    lo, hi = max(start, 0), min(end, x.shape[dim])
    out.narrow(dim, lo - start, hi - lo).copy_(x.narrow(dim, lo, hi - lo))
    return out


def _banded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    radii: Tensor,
    padding: Tensor,
    causal: bool,
    dropout_p: float,
    block_size: int,
) -> Tensor:
    """Window attention for heads whose radii are at most ``radii.max()``, by query blocks."""
    batch, heads, num_queries, head_dim = q.shape
    num_keys = k.shape[2]
    left = int(radii.max())
    right = 0 if causal else left
    block = min(block_size, num_queries)
    num_blocks = -(-num_queries // block)
    span = block + left + right
    # keys reachable from the query blocks, as positions relative to the first query
    start = num_keys - num_queries - left
    end = start + num_blocks * block + left + right
    keys = _key_window(k, start, end, 2, 0.0).unfold(2, span, block)  # B H nb d S
    values = _key_window(v, start, end, 2, 0.0).unfold(2, span, block).transpose(-1, -2)
    key_pad = _key_window(padding, start, end, 1, True).unfold(1, span, block)  # B nb S

    extra = num_blocks * block - num_queries
    queries = F.pad(q, (0, 0, 0, extra)).view(batch, heads, num_blocks, block, head_dim)
    block_radii = F.pad(radii, (0, extra)).view(batch, heads, num_blocks, block, 1)
    offsets = (
        torch.arange(span, device=q.device)[None, :]
        - left
        - torch.arange(block, device=q.device)[:, None]
    )
    allowed = window_allowed(block_radii, offsets, key_pad[:, None, :, None, :], causal)
    scores = torch.matmul(queries, keys) / math.sqrt(head_dim)
    probs = F.dropout(_masked_softmax(scores, allowed), p=dropout_p)
    out = torch.matmul(probs, values).view(batch, heads, num_blocks * block, head_dim)
    return out[:, :, :num_queries]


def multiscale_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scales: Sequence[Scale],
    key_padding_mask: Optional[Tensor] = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    block_size: int = 64,
) -> Tensor:
    """Multi-scale attention, memory O(n * (block_size + omega)) per head.

    Args:
        q: ``[B, H, Tq, d]`` queries (unscaled), placed at the last ``Tq`` key positions
            (``Tq == Tk`` for a full sequence, ``Tq == 1`` for a decoding step).
        k, v: ``[B, H, Tk, d]``.
        scales: one :class:`Scale` per head.
        key_padding_mask: ``[B, Tk]``, True at padding; padding can sit on either side.
        causal: queries see only keys at or before their own position.
        dropout_p: dropout on the attention weights.
        block_size: queries per block; heads whose block plus window covers every key use
            one dense block.

    Returns: ``[B, H, Tq, d]``; equal to :func:`multiscale_attention_reference`'s output.
    """
    _check_inputs(q, k, v, scales)
    padding = _default_padding(k, key_padding_mask)
    num_queries, num_keys = q.shape[2], k.shape[2]
    radii = window_radii(scales, padding, num_queries, causal)
    out = q.new_empty(q.shape[:3] + (v.shape[-1],))
    # heads whose key spans are within a factor of two share one call
    block = min(block_size, num_queries)
    side = 1 if causal else 2
    groups: Dict[int, List[int]] = {}
    for head, reach in enumerate(radii.amax(dim=(0, 2)).tolist()):
        groups.setdefault((block + side * reach).bit_length(), []).append(head)
    for heads in groups.values():
        index = torch.tensor(heads, device=q.device)
        group = [scales[head] for head in heads]
        gq, gk, gv = (x.index_select(1, index) for x in (q, k, v))
        group_radii = radii.index_select(1, index)
        reach = int(group_radii.max())
        if block + side * reach >= num_keys:
            group_out, _ = multiscale_attention_reference(
                gq, gk, gv, group, padding, causal, dropout_p
            )
        else:
            group_out = _banded_attention(
                gq, gk, gv, group_radii, padding, causal, dropout_p, block_size
            )
        out[:, index] = group_out
    return out


class MultiScaleSelfAttention(MultiheadAttention):
    """fairseq's self-attention with one window per head.

    Takes the same call as :class:`~fairseq.modules.MultiheadAttention` for
    self-attention (``query``/``key``/``value`` T x B x C, ``key_padding_mask``,
    ``incremental_state``, ``need_weights``, ``attn_mask``) and keeps its parameter names,
    so fairseq layers and checkpoints treat it as the stock module.  Causality comes from
    ``causal=True``, not from a dense ``attn_mask`` (which would cost the n x n memory
    this module avoids); a non-None ``attn_mask`` is refused.
    """

    def __init__(
        self,
        embed_dim: int,
        scales: Sequence[Scale],
        dropout: float = 0.0,
        causal: bool = False,
        block_size: int = 64,
        q_noise: float = 0.0,
        qn_block_size: int = 8,
    ):
        super().__init__(
            embed_dim,
            len(scales),
            dropout=dropout,
            self_attention=True,
            q_noise=q_noise,
            qn_block_size=qn_block_size,
        )
        self.scales = tuple(scales)
        self.causal = causal
        self.block_size = block_size

    def extra_repr(self) -> str:
        scales = ",".join(str(scale) for scale in self.scales)
        return f"scales=[{scales}], causal={self.causal}"

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("MultiScaleSelfAttention is self-attention: key and value must be the query")
        if attn_mask is not None:
            raise ValueError(
                "MultiScaleSelfAttention takes no attn_mask: windows come from its scales and "
                "causality from causal=True (build the decoder with buffered_future_mask -> None)"
            )
        if static_kv or before_softmax:
            raise ValueError("static_kv and before_softmax do not apply to multi-scale self-attention")
        if incremental_state is not None and not self.causal:
            raise ValueError("incremental decoding needs causal=True")

        q, k, v = (split_heads(proj(query), self.num_heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if incremental_state is not None:
            k, v, key_padding_mask = self._append_to_cache(incremental_state, k, v, key_padding_mask)

        dropout_p = self.dropout_module.p if self.training else 0.0
        weights: Optional[Tensor] = None
        if need_weights or need_head_weights:
            out, weights = multiscale_attention_reference(
                q, k, v, self.scales, key_padding_mask, self.causal, dropout_p
            )
            weights = weights.transpose(0, 1) if need_head_weights else weights.mean(dim=1)
        else:
            out = multiscale_attention(
                q, k, v, self.scales, key_padding_mask, self.causal, dropout_p, self.block_size
            )
        out = merge_heads(out)
        return self.out_proj(out), weights

    def _append_to_cache(
        self,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        k: Tensor,
        v: Tensor,
        key_padding_mask: Optional[Tensor],
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """Keys, values and padding of all steps so far, in fairseq's buffer layout
        (``prev_key``/``prev_value`` B x H x S x d, ``prev_key_padding_mask`` B x S), which
        MultiheadAttention.reorder_incremental_state already reorders for beam search."""
        saved = self._get_input_buffer(incremental_state)
        prev_key, prev_value = saved.get("prev_key"), saved.get("prev_value")
        prev_padding = saved.get("prev_key_padding_mask")
        if prev_key is not None and prev_value is not None:
            if key_padding_mask is not None or prev_padding is not None:
                if prev_padding is None:
                    prev_padding = k.new_zeros(k.shape[0], prev_key.shape[2], dtype=torch.bool)
                if key_padding_mask is None:
                    key_padding_mask = k.new_zeros(k.shape[0], k.shape[2], dtype=torch.bool)
                key_padding_mask = torch.cat([prev_padding.bool(), key_padding_mask.bool()], dim=1)
            k = torch.cat([prev_key, k], dim=2)
            v = torch.cat([prev_value, v], dim=2)
        saved["prev_key"], saved["prev_value"] = k, v
        saved["prev_key_padding_mask"] = key_padding_mask
        self._set_input_buffer(incremental_state, saved)
        return k, v, key_padding_mask
