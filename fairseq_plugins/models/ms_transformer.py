"""Multi-Scale Transformer for translation (Guo et al., 2019), as ``--arch ms_transformer``.

fairseq's transformer with multi-scale multi-head self-attention in the encoder and, optionally,
causal multi-scale self-attention in the decoder: its encoder and decoder are
:mod:`fairseq_plugins.modules.multiscale.multiscale_encoder_decoder`, the attention
:mod:`fairseq_plugins.modules.multiscale.multiscale_attention`.  The per-layer scales come from the paper's alpha
rule or explicit lists (:mod:`fairseq_plugins.modules.multiscale.scale_distribution`).  The paper's
encoder also drops the FFN (``--encoder-drop-ffn``: H <- LN(H + ReLU(MSMSA(H))), Eq. 10)
and the absolute positions (``--encoder-no-positions``); both are options here because
they were chosen for text classification, not translation.
"""

from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerModel,
    base_architecture,
    transformer_iwslt_de_en,
    transformer_wmt_en_de,
)

from fairseq_plugins.models.model_options import (
    PluginTransformerConfig, add_config_args, check_at_least, check_choice, set_default_options,
)
from fairseq_plugins.models.plugin_model import PluginModel
from fairseq_plugins.modules.multiscale.multiscale_encoder_decoder import (
    MultiScaleTransformerDecoder,
    MultiScaleTransformerEncoder,
)
from fairseq_plugins.modules.multiscale.scale_distribution import PAPER_CANDIDATES

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


@register_model("ms_transformer")
class MultiScaleTransformerModel(PluginModel, TransformerModel):
    """Transformer with multi-scale multi-head self-attention (one window per head)."""

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, MultiScaleTransformerConfig)

    @classmethod
    def build_model(cls, args, task):
        cfg = MultiScaleTransformerConfig.from_namespace(args)
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
