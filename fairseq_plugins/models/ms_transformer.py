"""Multi-Scale Transformer for translation (Guo et al., 2019), as ``--arch ms_transformer``.

fairseq's transformer with multi-scale multi-head self-attention
(:mod:`fairseq_plugins.modules.multiscale.multiscale_attention`) in the encoder and, optionally, causal
multi-scale self-attention in the decoder.  The per-layer scales come from the paper's alpha
rule or explicit lists (:mod:`fairseq_plugins.modules.multiscale.scale_distribution`).  The paper's
encoder also drops the FFN (``--encoder-drop-ffn``: H <- LN(H + ReLU(MSMSA(H))), Eq. 10)
and the absolute positions (``--encoder-no-positions``); both are options here because
they were chosen for text classification, not translation.
"""

import copy
from dataclasses import dataclass, field

from torch import nn

from fairseq.dataclass import ChoiceEnum
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerDecoder,
    TransformerEncoder,
    TransformerModel,
    base_architecture,
    transformer_iwslt_de_en,
    transformer_wmt_en_de,
)
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)

from fairseq_plugins.models.model_options import (
    PluginTransformerConfig, add_config_args, check_at_least, check_choice, set_default_options,
)
from fairseq_plugins.models.plugin_model import PluginModel
from fairseq_plugins.modules.common.layer_wrapping import wrap_layer
from fairseq_plugins.modules.multiscale.multiscale_attention import MultiScaleSelfAttention
from fairseq_plugins.modules.multiscale.scale_distribution import PAPER_CANDIDATES, layer_scales

DECODER_SELF_ATTENTIONS = ("standard", "multiscale")


@dataclass
class MultiScaleTransformerConfig(PluginTransformerConfig):
    """fairseq's transformer options plus the multi-scale ones."""

    scale_candidates: str = field(default=PAPER_CANDIDATES, metadata={
        "help": "candidate scales of the alpha rule, smallest first: odd widths, 'N/<k>' (fraction of the "
                "sentence length), 'N' or 'all'"})
    encoder_scales: str = field(default="", metadata={
        "help": "per-head encoder scales: comma-separated, one list per layer separated by '|' (one list = "
                "every layer), or 'paper-example'; empty: the alpha rule"})
    encoder_scale_alpha: float = field(default=0.5, metadata={
        "help": "alpha of the scale distribution (>0: lower layers more local)"})
    encoder_drop_ffn: bool = field(default=False, metadata={
        "help": "paper's encoder layer H <- LN(H + ReLU(MSMSA(H))), no FFN"})
    encoder_no_positions: bool = field(default=False, metadata={
        "help": "no positional embeddings in the encoder (the paper's choice)"})
    decoder_self_attention: ChoiceEnum(DECODER_SELF_ATTENTIONS) = field(default="standard", metadata={
        "help": "decoder self-attention: standard, or causal multi-scale"})
    decoder_scales: str = field(default="", metadata={"help": "per-head decoder scales, as --encoder-scales"})
    decoder_scale_alpha: float = field(default=0.5, metadata={
        "help": "alpha of the decoder's scale distribution"})
    multiscale_block_size: int = field(default=64, metadata={
        "help": "queries per block in the banded attention kernel"})


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
    def __init__(self, args, dictionary, embed_tokens):
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


@register_model("ms_transformer")
class MultiScaleTransformerModel(PluginModel, TransformerModel):
    """Transformer with multi-scale multi-head self-attention (one window per head)."""

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, MultiScaleTransformerConfig)

    @classmethod
    def build_model(cls, args, task):
        cfg = MultiScaleTransformerConfig.from_namespace(args)
        if not cfg.scale_candidates:
            raise ValueError("--scale-candidates is empty: give the candidate scales (default "
                             f"{PAPER_CANDIDATES!r})")
        check_choice(cfg, "decoder_self_attention", DECODER_SELF_ATTENTIONS)
        check_at_least(cfg, "multiscale_block_size", 1)
        return super().build_model(cfg, task)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return MultiScaleTransformerEncoder(args, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return MultiScaleTransformerDecoder(
            args, tgt_dict, embed_tokens, no_encoder_attn=args.no_cross_attention
        )


def _multiscale_defaults(args):
    set_default_options(args, MultiScaleTransformerConfig)


@register_model_architecture("ms_transformer", "ms_transformer")
def ms_transformer(args):
    _multiscale_defaults(args)
    base_architecture(args)


@register_model_architecture("ms_transformer", "ms_transformer_iwslt_de_en")
def ms_transformer_iwslt_de_en(args):
    _multiscale_defaults(args)
    transformer_iwslt_de_en(args)


@register_model_architecture("ms_transformer", "ms_transformer_wmt_en_de")
def ms_transformer_wmt_en_de(args):
    _multiscale_defaults(args)
    transformer_wmt_en_de(args)
