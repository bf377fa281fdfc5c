"""BP-Transformer for translation (Ye et al., 2019): binary-partition graph attention.

Each side (encoder, decoder, or both; ``--graph-sides``) runs over the nodes of a tree built on
its sentence (``modules/bpt/graph_transformer.py``); the other side, if any, is fairseq's. This
file holds the options (``GraphTransformerConfig``), the model's build hooks and the
architectures.
"""

from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer.transformer_legacy import base_architecture, transformer_iwslt_de_en

from fairseq_plugins.graph_attention.registry import BACKEND_NAMES
from fairseq_plugins.graphs.binary_partition import TreeGraphSpec
from fairseq_plugins.models.model_options import (
    OptionError, PluginTransformerConfig, add_config_args, check_at_least, check_choice, set_default_options,
)
from fairseq_plugins.models.plugin_model import PluginModel
from fairseq_plugins.modules.bpt.graph_transformer import GraphTransformerDecoder, GraphTransformerEncoder
from fairseq_plugins.modules.bpt.graph_transformer_layers import CROSS_ATTENTION_FROM

GRAPH_SIDES = ("encoder", "decoder", "both")
TOKEN_POSITIONS = ("none", "absolute")
GRAPH_ATTENTION_BACKENDS = ("auto", *BACKEND_NAMES)
# what the plugin did before the paper's choices became options; configs built then lack them
PLUGIN_V1 = dict(graph_token_positions="absolute", graph_cross_attention="nodes")


@dataclass
class GraphTransformerConfig(PluginTransformerConfig):
    """fairseq's transformer options plus those of the tree-graph models (BPT, SegTree)."""

    graph_k: int = field(default=4, metadata={"help": "context nodes per level and side (BPT's k; SegTree: 1)"})
    graph_rel_clip: int = field(
        default=2, metadata={"help": "levels >= L share their relative-position embeddings (>= 1)"})
    graph_sides: ChoiceEnum(GRAPH_SIDES) = field(
        default="both", metadata={"help": "which side(s) use graph attention; the other is a stock transformer"})
    graph_token_positions: ChoiceEnum(TOKEN_POSITIONS) = field(
        default="none", metadata={"help": "what token nodes start from on a graph side: none = word embeddings "
                                          "only, order from the tree's relative positions (the papers); "
                                          "absolute = plus fairseq's positional embeddings (plugin v1)"})
    graph_cross_attention: ChoiceEnum(CROSS_ATTENTION_FROM) = field(
        default="tokens", metadata={"help": "which decoder nodes attend to the encoder: tokens (BPT sec. 4.3) "
                                            "or nodes = tokens and spans (plugin v1)"})
    graph_attention_backend: ChoiceEnum(GRAPH_ATTENTION_BACKENDS) = field(
        default="auto", metadata={"help": "graph attention implementation (see docs/cuda_ext.md)"})
    graph_recompute_norms_ffn: bool = field(
        default=False, metadata={"help": "recompute the graph layers' layer norms and FFN hidden states in the "
                                         "backward (the FFN a chunk of rows at a time): less activation memory "
                                         "for one more FFN product"})




def built_by_plugin_v1(args) -> bool:
    """A model config saved before the paper options existed: those builds wrote the graph
    kind into it (``graph_kind``); builds now keep it off the config they are given."""
    return getattr(args, "graph_kind", None) is not None


@register_model("bpt_transformer")
class BPTTransformerModel(PluginModel, TransformerModel):
    """Transformer whose self-attention runs over a binary-partition graph (BPT)."""

    graph_kind = "bpt"

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, GraphTransformerConfig)

    @classmethod
    def build_model(cls, args, task):
        cfg = GraphTransformerConfig.from_namespace(args)
        if cls.graph_kind == "segtree" and built_by_plugin_v1(args):
            cfg.graph_k = 1  # SegTree's k is 1; those versions ignored --graph-k
        cfg.graph_kind = cls.graph_kind
        validate_graph_options(cfg)
        return super().build_model(cfg, task)

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        if cfg.graph_sides in ("encoder", "both"):
            return GraphTransformerEncoder(cfg, src_dict, embed_tokens)
        return super().build_encoder(cfg, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        if cfg.graph_sides in ("decoder", "both"):
            return GraphTransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)
        return super().build_decoder(cfg, tgt_dict, embed_tokens)


def validate_graph_options(cfg, length_flag: str = "--max-source/target-positions") -> None:
    """Clear errors for values no graph can have (nothing is replaced by a default here);
    ``length_flag`` is the option that bounds the sequences (a language model's: its
    --tokens-per-sample)."""
    check_at_least(cfg, "graph_k", 1)
    check_at_least(cfg, "graph_rel_clip", 1)
    if cfg.graph_kind == "segtree" and cfg.graph_k != 1:
        raise OptionError(f"--graph-k {cfg.graph_k}: SegTree's graph has k = 1 by definition (use bpt_transformer "
                         f"for other k)")
    check_choice(cfg, "graph_sides", GRAPH_SIDES)
    check_choice(cfg, "graph_token_positions", TOKEN_POSITIONS)
    check_choice(cfg, "graph_cross_attention", CROSS_ATTENTION_FROM)
    check_choice(cfg, "graph_attention_backend", GRAPH_ATTENTION_BACKENDS)
    check_graph_k_helps(cfg, length_flag)  # after the choices: it reads --graph-sides


def check_graph_k_helps(cfg, length_flag: str) -> None:
    """k past the longest sequence is dense attention that only grows the relative-position
    table (``k + 1`` slots per side and level: ``head_dim`` parameters per type and graph layer)."""
    sides = {"encoder": (cfg.encoder, cfg.max_source_positions), "decoder": (cfg.decoder, cfg.max_target_positions)}
    graph_sides = [side for side in sides if cfg.graph_sides in (side, "both")]
    bound = max(sides[side][1] for side in graph_sides) - 1
    if cfg.graph_k <= bound:
        return
    per_type = sum(sides[side][0].layers * sides[side][0].embed_dim // sides[side][0].attention_heads
                   for side in graph_sides)

    def table(k):
        return TreeGraphSpec(cfg.graph_kind, k, cfg.graph_rel_clip, False).types.num_types * per_type

    raise OptionError(
        f"--graph-k {cfg.graph_k} is beyond what can help: at k = {bound} (the longest sequence, "
        f"{length_flag} {bound + 1}, minus one) every token already sees all the others at level 0, i.e. "
        f"dense attention; a larger k only grows the relative-position embeddings, to {table(cfg.graph_k):,} "
        f"parameters here ({table(bound):,} at k {bound}, {table(4):,} at the paper's k 4). Use --graph-k <= {bound}"
    )


def graph_defaults(args, k: int, clip: int):
    """Unset graph options: this architecture's k and clip, the papers' choices for the rest
    (plugin v1's for a config saved by it, so that its checkpoints keep their behaviour)."""
    set_default_options(args, GraphTransformerConfig, graph_k=k, graph_rel_clip=clip,
                        **(PLUGIN_V1 if built_by_plugin_v1(args) else {}))


@register_model_architecture("bpt_transformer", "bpt_transformer")
def bpt_transformer(args):
    """The paper's WMT base setting: 6+6 layers, d 512, FFN 2048, 8 heads, k 4."""
    graph_defaults(args, k=4, clip=2)
    base_architecture(args)


# the original configurations pair each k with a level clip
_WMT_CLIP = {1: 4, 2: 3, 4: 2, 8: 1}


def _register_variants():
    for k, clip in _WMT_CLIP.items():
        def wmt(args, k=k, clip=clip):
            graph_defaults(args, k, clip)
            base_architecture(args)

        def iwslt(args, k=k):
            graph_defaults(args, k, 3)
            transformer_iwslt_de_en(args)

        register_model_architecture("bpt_transformer", f"bpt_transformer_wmt_en_de_k{k}")(wmt)
        register_model_architecture("bpt_transformer", f"bpt_transformer_iwslt_de_en_k{k}")(iwslt)


_register_variants()


@register_model_architecture("bpt_transformer", "bpt_transformer_wmt_en_de")
def bpt_transformer_wmt_en_de(args):
    graph_defaults(args, k=4, clip=2)
    base_architecture(args)


@register_model_architecture("bpt_transformer", "bpt_transformer_iwslt_de_en")
def bpt_transformer_iwslt_de_en(args):
    """IWSLT size (FFN 1024, 4 heads), k 4, clip 3 as in the original IWSLT config."""
    graph_defaults(args, k=4, clip=3)
    transformer_iwslt_de_en(args)
