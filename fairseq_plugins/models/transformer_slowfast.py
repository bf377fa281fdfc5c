"""TranSFormer: the Slow-Fast Transformer for machine translation (Li et al., 2023), as
``--arch transformer_slowfast``.

fairseq's transformer whose encoder is TranSFormer's two-branch encoder
(:mod:`fairseq_plugins.modules.slowfast.slowfast_encoder`): a slow branch over subwords and a
thin fast branch over their characters, exchanging information by cross-granularity attention;
the decoder is fairseq's. Every ablation of the paper's Tables 4-6 is a command-line option
(docs/slowfast.md).
"""

from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer.transformer_legacy import (
    base_architecture,
    transformer_iwslt_de_en,
    transformer_wmt_en_de_big,
)

from fairseq_plugins.models.model_options import PluginTransformerConfig, add_config_args, set_default_options
from fairseq_plugins.models.plugin_model import PluginModel
from fairseq_plugins.modules.slowfast.cross_granularity_fusion import FUSION_METHODS
from fairseq_plugins.modules.slowfast.ode_block import ODE_SOLVERS
from fairseq_plugins.modules.slowfast.sentencepiece_fast_input import piece_count
from fairseq_plugins.modules.slowfast.slowfast_encoder import (
    BOUNDARY_PE_SCOPES,
    ENCODER_OUTPUTS,
    FAST_BOUNDARIES,
    FAST_INPUTS,
    FAST_SELF_ATTENTIONS,
    SlowFastEncoder,
    read_sentencepiece_model,
)
from fairseq_plugins.modules.slowfast.subword_characters import SUBWORD_STYLES


@dataclass
class SlowFastConfig(PluginTransformerConfig):
    """fairseq's transformer options plus TranSFormer's (paper Sec. 4.1 defaults)."""

    no_fast_branch: bool = field(default=False, metadata={
        "help": "slow branch only (subword encoder with its word GCN): the paper's slow-only baseline"})
    no_slow_branch: bool = field(default=False, metadata={
        "help": "fast branch only (characters, its F-GCN and boundary PE, projected to the decoder's width): "
                "the paper's Fast Only baseline (Table 1); with --fast-boundaries none --no-boundary-pe, a plain "
                "character-level encoder"})
    no_slow_word_graph: bool = field(default=False, metadata={
        "help": "no S-GCN: the slow branch is the stock encoder (ablation)"})
    slowfast_post_norm: bool = field(default=False, metadata={
        "help": "layer norm after each residual sublayer, encoder and decoder, as the stock transformer "
                "(default: pre-norm, as the paper)"})
    fast_embed_dim: int = field(default=32, metadata={"help": "fast branch width (paper: 32 base, 64 Zh-En big)"})
    fast_ffn_embed_dim: Optional[int] = field(default=None, metadata={
        "help": "fast branch FFN size (default: 4 x --fast-embed-dim; paper: 128 at width 32)"})
    fast_attention_heads: int = field(default=4, metadata={"help": "fast branch attention heads"})
    fast_input: ChoiceEnum(FAST_INPUTS) = field(default="char", metadata={
        "help": "fast branch input: characters, the subwords themselves, or the source re-segmented by "
                "--fast-sentencepiece-model (Table 4d)"})
    fast_sentencepiece_model: Optional[str] = field(default=None, metadata={
        "help": "sentencepiece .model for --fast-input sentencepiece (kept in the checkpoint)"})
    fast_sentencepiece_pieces: Optional[int] = field(default=None, metadata={
        "help": "set by the model: the size of --fast-sentencepiece-model, so that a checkpoint builds "
                "without the file"})
    subword_style: ChoiceEnum(SUBWORD_STYLES) = field(default="auto", metadata={
        "help": "source vocabulary markers: subword-nmt @@ or sentencepiece \u2581 (auto: detect)"})
    fast_max_characters: int = field(default=0, metadata={
        "help": "keep the N most frequent characters, others map to unknown (0: all)"})
    slowfast_fusion: ChoiceEnum(FUSION_METHODS) = field(default="cga", metadata={
        "help": "fusion between branches (Table 4b)"})
    slowfast_encoder_output: ChoiceEnum(ENCODER_OUTPUTS) = field(default="slow", metadata={
        "help": "what the decoder attends to (Table 4c)"})
    unidirectional_fusion: bool = field(default=False, metadata={
        "help": "only the slow branch receives the fast one (Table 5 #2)"})
    fast_boundaries: ChoiceEnum(FAST_BOUNDARIES) = field(default="word", metadata={
        "help": "character-to-word boundaries for the F-GCN and boundary PE: real, random, or none (no F-GCN, "
                "PE not restricted to words) (Table 5 #3, #4)"})
    no_boundary_pe: bool = field(default=False, metadata={
        "help": "no boundary-wise relative positions in the fast branch (Table 5 #5)"})
    boundary_pe_window: int = field(default=3, metadata={"help": "relative window k of the boundary PE (paper: 3)"})
    boundary_pe_scope: ChoiceEnum(BOUNDARY_PE_SCOPES) = field(default="word", metadata={
        "help": "what the fast branch's relative window covers: word = the character's own word (the paper's "
                "boundary-wise PE), window = every character within k (vanilla relative PE, Shaw et al. 2018: "
                "Table 5 #5, Figure 4a)"})
    fast_self_attention: ChoiceEnum(FAST_SELF_ATTENTIONS) = field(default="full", metadata={
        "help": "fast branch self-attention: full, or linear (Linformer, no boundary PE) (Table 5 #6)"})
    fast_linear_attention_length: int = field(default=64, metadata={
        "help": "Linformer's k: keys and values projected to this length"})
    fast_linear_attention_max_length: int = field(default=2048, metadata={
        "help": "Linformer's n: the longest fast-branch sequence the projections cover"})
    slowfast_interaction_layers: str = field(default="all", metadata={
        "help": "blocks with fusion: all, last, bottomN, topN, everyN or 1-based list (Table 6)"})
    slowfast_ode_block: ChoiceEnum(ODE_SOLVERS) = field(default="euler", metadata={
        "help": "encoder blocks as ODE steps (Li et al., 2022): euler = the plain residual block; rk2 = the "
                "block applied twice, y + (F(y) + F(y + F(y))) / 2; rk2-gated = RK2 with learnable gated "
                "coefficients (Table 1's TranSFormer + ODE)"})


@register_model("transformer_slowfast")
class TransformerSlowFastModel(PluginModel, TransformerModel):
    """fairseq's transformer with TranSFormer's two-branch encoder."""

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, SlowFastConfig)

    @classmethod
    def build_model(cls, args, task):
        if args.fast_input == "sentencepiece" and not args.no_fast_branch:
            # recorded in the checkpoint's arguments: it then builds without the .model file
            model_proto = read_sentencepiece_model(args)
            if model_proto is not None:
                args.fast_sentencepiece_pieces = piece_count(model_proto)
        return super().build_model(SlowFastConfig.from_namespace(args), task)

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return SlowFastEncoder(cfg, src_dict, embed_tokens)


def slowfast_defaults(args):
    """TranSFormer-specific defaults (paper Sec. 4.1); pre-norm as in the paper unless
    ``--slowfast-post-norm`` (fairseq's store-true norm flags cannot be turned off)."""
    # the fast branch alone: the decoder reads it
    set_default_options(args, SlowFastConfig,
                        slowfast_encoder_output="fast" if getattr(args, "no_slow_branch", None) else "slow")
    if args.fast_ffn_embed_dim is None:
        args.fast_ffn_embed_dim = 4 * args.fast_embed_dim
    if args.slowfast_post_norm:
        if getattr(args, "encoder_normalize_before", False) or getattr(args, "decoder_normalize_before", False):
            raise ValueError("--slowfast-post-norm contradicts --encoder/decoder-normalize-before")
        args.encoder_normalize_before = args.decoder_normalize_before = False
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", True)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)


@register_model_architecture("transformer_slowfast", "transformer_slowfast")
def slowfast_base_architecture(args):
    """WMT En-De base: slow 512/2048, 8 heads, 6 layers; fast width 32, FFN 128."""
    slowfast_defaults(args)
    base_architecture(args)


@register_model_architecture("transformer_slowfast", "transformer_slowfast_wmt_en_de")
def slowfast_wmt_en_de(args):
    slowfast_base_architecture(args)


@register_model_architecture("transformer_slowfast", "transformer_slowfast_wmt_en_de_big")
def slowfast_wmt_en_de_big(args):
    """WMT En-De big: slow 1024/4096, 16 heads, residual dropout 0.3; fast width 32."""
    slowfast_defaults(args)
    transformer_wmt_en_de_big(args)


@register_model_architecture("transformer_slowfast", "transformer_slowfast_wmt_zh_en_big")
def slowfast_wmt_zh_en_big(args):
    """WMT Zh-En big: as En-De big with fast width 64 (FFN 256)."""
    args.fast_embed_dim = getattr(args, "fast_embed_dim", 64)
    slowfast_wmt_en_de_big(args)


@register_model_architecture("transformer_slowfast", "transformer_slowfast_wmt_en_ro")
def slowfast_wmt_en_ro(args):
    """WMT En-Ro: base sizes (the paper's 40K joint BPE vocabulary goes with
    ``--share-all-embeddings`` and a joined dictionary)."""
    slowfast_base_architecture(args)


@register_model_architecture("transformer_slowfast", "transformer_slowfast_iwslt_de_en")
def slowfast_iwslt_de_en(args):
    """IWSLT sizes: slow 512/1024, 4 heads; fast width 32."""
    slowfast_defaults(args)
    transformer_iwslt_de_en(args)
