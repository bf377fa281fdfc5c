"""fairseq's transformer encoder and decoder with multi-scale multi-head self-attention (Guo et al., 2019).

Each layer's heads have their own window widths (:mod:`.scale_distribution` gives them per layer);
the encoder layer can be the paper's H <- LN(H + act(MSMSA(H))) without an FFN, and the decoder's
self-attention is either fairseq's or causal multi-scale (left windows). The options they read
are ``--arch ms_transformer``'s (docs/ms_transformer.md).
"""

import copy

from torch import nn

from fairseq.models.transformer import TransformerDecoder, TransformerEncoder
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)

from fairseq_plugins.modules.common.layer_wrapping import wrap_layer

from .multiscale_attention import MultiScaleSelfAttention
from .scale_distribution import PAPER_CANDIDATES, layer_scales


def _multiscale_self_attention(layer, embed_dim, cfg, causal: bool) -> MultiScaleSelfAttention:
    """The self-attention of a multi-scale layer (its scales and block size set on the layer)."""
    return MultiScaleSelfAttention(
        embed_dim, layer.scales, dropout=cfg.attention_dropout, causal=causal,
        block_size=layer.block_size, q_noise=layer.quant_noise,
        qn_block_size=layer.quant_noise_block_size,
    )


class MultiScaleEncoderLayer(TransformerEncoderLayerBase):
    """Encoder layer with multi-scale self-attention; with ``drop_ffn`` the layer is the
    paper's H <- LN(H + act(MSMSA(H))) with no feed-forward block."""

    def __init__(self, cfg, scales, drop_ffn: bool, block_size: int):
        self.scales = scales
        self.block_size = block_size
        super().__init__(cfg)
        self.drop_ffn = drop_ffn
        if drop_ffn:
            # the FFN and the fused-path copies of its weights
            for name in ("fc1", "fc2", "final_layer_norm", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
                delattr(self, name)

    def build_self_attention(self, embed_dim, cfg):
        return _multiscale_self_attention(self, embed_dim, cfg, causal=False)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # fairseq's loader switches on its fused BetterTransformer path, which would compute
        # full attention (and expects FFN weights); load the plain nn.Module way instead.
        nn.Module._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)

    def forward(self, x, encoder_padding_mask, attn_mask=None):
        if not self.drop_ffn:
            return super().forward(x, encoder_padding_mask, attn_mask)
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(
            query=x, key=x, value=x, key_padding_mask=encoder_padding_mask,
            need_weights=False, attn_mask=attn_mask,
        )  # fmt: skip
        x = self.dropout_module(self.activation_fn(x))
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)
        return x


class MultiScaleDecoderLayer(TransformerDecoderLayerBase):
    """Decoder layer whose self-attention is causal multi-scale (left windows)."""

    def __init__(self, cfg, scales, block_size: int, no_encoder_attn: bool = False):
        self.scales = scales
        self.block_size = block_size
        super().__init__(cfg, no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise ValueError(
                "multi-scale decoder self-attention supports neither bias_kv, zero_attn nor cross_self_attention"
            )
        return _multiscale_self_attention(self, embed_dim, cfg, causal=True)


def _scales_per_layer(args, side: str):
    return layer_scales(
        getattr(args, f"{side}_scales"),
        num_heads=getattr(args, f"{side}_attention_heads"),
        num_layers=getattr(args, f"{side}_layers"),
        alpha=getattr(args, f"{side}_scale_alpha"),
        candidates=args.scale_candidates,
    )


class MultiScaleTransformerEncoder(TransformerEncoder):
    """The translation model's and the classifier's encoder."""

    def __init__(self, args, dictionary, embed_tokens):
        if not args.scale_candidates:
            raise ValueError(f"--scale-candidates is empty: give the candidate scales (default {PAPER_CANDIDATES!r})")
        self.layer_scales = iter(_scales_per_layer(args, "encoder"))
        if args.encoder_no_positions:
            args = copy.copy(args)
            args.no_token_positional_embeddings = True
        super().__init__(args, dictionary, embed_tokens)

    def build_encoder_layer(self, cfg):
        layer = MultiScaleEncoderLayer(
            cfg, next(self.layer_scales), cfg.encoder_drop_ffn, cfg.multiscale_block_size
        )
        return wrap_layer(layer, cfg)


class MultiScaleTransformerDecoder(TransformerDecoder):
    """Standard decoder, or with ``--decoder-self-attention multiscale`` causal windows."""

    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        self.multiscale = args.decoder_self_attention == "multiscale"
        self.layer_scales = iter(_scales_per_layer(args, "decoder")) if self.multiscale else None
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn, output_projection)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        if not self.multiscale:
            return super().build_decoder_layer(cfg, no_encoder_attn)
        layer = MultiScaleDecoderLayer(
            cfg, next(self.layer_scales), cfg.multiscale_block_size, no_encoder_attn
        )
        return wrap_layer(layer, cfg)

    def buffered_future_mask(self, tensor):
        # causal windows mask the future themselves, without an n x n mask
        return None if self.multiscale else super().buffered_future_mask(tensor)
