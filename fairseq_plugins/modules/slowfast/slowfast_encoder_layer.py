"""Encoder blocks of TranSFormer's two branches (paper Fig. 3).

A block is ``word GCN -> self-attention -> cross-granularity fusion -> FFN``, each a
residual sublayer (pre-norm when ``cfg.encoder.normalize_before``). The two branches
must run their fusion sublayers on each other's post-attention states, so instead of
one ``forward`` a block exposes its halves and the encoder interleaves the branches.
Both reuse fairseq's ``TransformerEncoderLayerBase`` (self-attention, FFN, norms,
dropout); the fast branch only swaps in the boundary-wise relative self-attention.
"""

from typing import Callable, Optional

import torch
from torch import nn

from fairseq.modules import LayerNorm
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from .boundary_relative_attention import BoundaryRelativeSelfAttention
from .linear_self_attention import LinformerSelfAttention
from .word_graph_convolution import WordGraph, WordGraphConvolution


# fairseq's copies of the weights for torch's fused encoder-layer kernel, which these
# blocks never call: dropped so that no parameter goes unused.
_FUSED_KERNEL_PARAMETERS = (
    "in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias",
    "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias",
)  # fmt: skip


class SlowFastEncoderLayer(TransformerEncoderLayerBase):
    """One branch's block. ``use_word_graph`` adds the GCN over the units of a word;
    ``fusion`` (a module from ``cross_granularity_fusion``) adds the fusion sublayer;
    ``feed_forward=False`` drops the FFN (the fast branch's last block when only its
    attention output is read by the slow branch)."""

    def __init__(self, cfg, use_word_graph: bool, fusion: Optional[nn.Module] = None, feed_forward: bool = True):
        super().__init__(cfg)
        for name in _FUSED_KERNEL_PARAMETERS:
            delattr(self, name)
        self.has_feed_forward = feed_forward
        if not feed_forward:
            del self.fc1, self.fc2, self.final_layer_norm
        self.word_graph = WordGraphConvolution(self.embed_dim) if use_word_graph else None
        self.word_graph_layer_norm = LayerNorm(self.embed_dim) if use_word_graph else None
        self.fusion = fusion
        self.fusion_layer_norm = LayerNorm(self.embed_dim) if fusion is not None else None

    def _sublayer(self, x: torch.Tensor, layer_norm: nn.Module, fn: Callable) -> torch.Tensor:
        residual = x
        if self.normalize_before:
            x = layer_norm(x)
        x = self.residual_connection(self.dropout_module(fn(x)), residual)
        if not self.normalize_before:
            x = layer_norm(x)
        return x

    def attend(self, x, padding_mask, band=None):
        return self.self_attn(query=x, key=x, value=x, key_padding_mask=padding_mask, need_weights=False)[0]

    def forward_graph_and_attention(self, x, padding_mask, graph: Optional[WordGraph], band=None):
        """x: T x B x C; padding_mask: B x T (or None); graph: the batch's word graph;
        band: the fast branch's boundary relations (``boundary_band``)."""
        if self.word_graph is not None:
            x = self._sublayer(x, self.word_graph_layer_norm, lambda h: self.word_graph(h, graph))
        return self._sublayer(x, self.self_attn_layer_norm, lambda h: self.attend(h, padding_mask, band))

    def forward_fusion(self, x, context, context_padding_mask, subword_ids):
        if self.fusion is None:
            return x
        return self._sublayer(
            x, self.fusion_layer_norm, lambda h: self.fusion(h, context, context_padding_mask, subword_ids)
        )

    def forward_feed_forward(self, x):
        if not self.has_feed_forward:
            raise RuntimeError("this block was built without its feed-forward sublayer")

        def ffn(h):
            return self.fc2(self.activation_dropout_module(self.activation_fn(self.fc1(h))))

        return self._sublayer(x, self.final_layer_norm, ffn)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # plain loading: the base class would re-create the fused-kernel copies
        nn.Module._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)

    def forward(self, x, encoder_padding_mask, attn_mask=None):
        raise NotImplementedError("slow-fast layers run in halves: use SlowFastEncoder")


class FastBranchEncoderLayer(SlowFastEncoderLayer):
    """Fast-branch block: self-attention with boundary-wise relative positions
    (window ``cfg.boundary_pe_window``; None: plain attention), or Linformer attention
    when ``cfg.fast_self_attention == "linear"``."""

    def build_self_attention(self, embed_dim, cfg):
        if cfg.fast_self_attention == "linear":
            return LinformerSelfAttention(
                embed_dim, cfg.encoder.attention_heads, cfg.fast_linear_attention_length,
                cfg.fast_linear_attention_max_length, dropout=cfg.attention_dropout,
            )  # fmt: skip
        return BoundaryRelativeSelfAttention(
            embed_dim, cfg.encoder.attention_heads, window=cfg.boundary_pe_window, dropout=cfg.attention_dropout
        )

    def attend(self, x, padding_mask, band=None):
        return self.self_attn(x, padding_mask, band)
