"""BP-Transformer and SegTree as language models for fairseq's ``--task language_modeling``.

fairseq's ``transformer_lm`` is a ``TransformerDecoder`` without cross-attention; these are the
causal graph decoder of ``bpt_transformer`` (``GraphTransformerDecoder``) in the same place. A
token attends to itself and O(k log t) tree nodes covering its left context, spans to their
tokens; token order comes from the tree's relative positions (``--graph-token-positions none``,
the papers' choice), so the context length is bounded only by ``--tokens-per-sample``: a
checkpoint loaded by a task with longer blocks (fairseq-eval-lm at a longer context) takes them.
Incremental decoding (sampling with fairseq's generator) is the decoder's: one new token and
the spans it completes per step, O(k log t) cached nodes each.
"""

from fairseq.utils import safe_getattr
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture

from fairseq_plugins.models.bpt_transformer import GraphTransformerConfig, graph_defaults, validate_graph_options
from fairseq_plugins.models.lm_training import LMTrainingConfig, LMTrainingDecoder, lm_training
from fairseq_plugins.models.model_options import (
    add_config_args, check_lm_context, config_with_options, lm_max_positions, task_tokens_per_sample,
)
from fairseq_plugins.models.plugin_model import PluginModel
from fairseq_plugins.modules.bpt.graph_transformer import GraphTransformerDecoder

# the graph options that mean something without an encoder
LM_GRAPH_OPTIONS = ("graph_k", "graph_rel_clip", "graph_token_positions", "graph_attention_backend",
                    "graph_recompute_norms_ffn")
GraphLanguageModelConfig = config_with_options(
    "GraphLanguageModelConfig", LMTrainingConfig, GraphTransformerConfig, LM_GRAPH_OPTIONS, __name__)


class GraphLanguageModelDecoder(LMTrainingDecoder, GraphTransformerDecoder):
    """The causal graph decoder with the language models' dropouts and norm placement
    (``lm_training``); the translation models keep ``GraphTransformerDecoder``."""


@register_model("bpt_lm")
class BPTLanguageModel(PluginModel, TransformerLanguageModel):
    """``transformer_lm`` whose decoder attends over the causal binary-partition graph."""

    language_model = True
    graph_kind = "bpt"
    graph_config = GraphTransformerConfig  # the options the decoder is built with

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, GraphLanguageModelConfig)

    @classmethod
    def build_model(cls, args, task):
        cls.check_task(args, task)
        for option in ("character_embeddings", "adaptive_input"):
            if getattr(args, option, False):
                raise ValueError(f"--{option.replace('_', '-')} is not supported by {cls.graph_kind}_lm")
        lm_max_positions(args, f"{cls.graph_kind}_lm")
        if safe_getattr(args, "graph_token_positions", None) == "absolute":  # a hydra config may leave it out
            check_lm_context(args, task, f"{cls.graph_kind}_lm")
        else:  # nothing bounds a context of relative positions: score the blocks the task cuts, however long
            args.max_target_positions = max(args.max_target_positions, task_tokens_per_sample(task) or 0)
        training = lm_training(args, f"{cls.graph_kind}_lm")
        cfg = cls.graph_config.from_namespace(args)
        cfg.graph_kind = cls.graph_kind
        cfg.graph_sides = "decoder"  # a language model has no encoder: its positions bound graph-k
        validate_graph_options(cfg, length_flag="--tokens-per-sample")
        embed_tokens = cls.build_embedding(args, task.source_dictionary, args.decoder_input_dim)
        return cls(GraphLanguageModelDecoder(training, cfg, task.target_dictionary, embed_tokens, no_encoder_attn=True))


@register_model("segtree_lm")
class SegTreeLanguageModel(BPTLanguageModel):
    """The same with SegTree's graph (k = 1, neighbours, span self-loops)."""

    graph_kind = "segtree"


# Table 3's sizes: k 64, relative levels clipped at 6 as the original's 8192-token configs (``clip_dist: 6``;
# shorter contexts clip lower, which their table rows set).
BPT_LM_K, BPT_LM_CLIP = 64, 6
SEGTREE_CLIP = 4


@register_model_architecture("bpt_lm", "bpt_lm")
def bpt_lm(args):
    """fairseq's ``transformer_lm`` sizes (6 layers, d 512, FFN 2048, 8 heads, pre-norm) with the
    paper's character-level graph: k 64, relative levels clipped at 6."""
    graph_defaults(args, k=BPT_LM_K, clip=BPT_LM_CLIP)
    base_lm_architecture(args)


def bpt_paper_sizes(args):
    """BPT Table 9 (enwik8 and text8 alike): 12 layers, d 512, FFN 2048, 8 heads, dropout 0.1 on
    embeddings, hidden layers and attention weights (also the sizes of Figure 5's window baseline)."""
    args.decoder_layers = safe_getattr(args, "decoder_layers", 12)
    args.decoder_embed_dim = safe_getattr(args, "decoder_embed_dim", 512)
    args.decoder_ffn_embed_dim = safe_getattr(args, "decoder_ffn_embed_dim", 2048)
    args.decoder_attention_heads = safe_getattr(args, "decoder_attention_heads", 8)
    args.dropout = safe_getattr(args, "dropout", 0.1)
    args.attention_dropout = safe_getattr(args, "attention_dropout", 0.1)


def _bpt_paper_lm(args):
    """BPT Table 9's sizes with k 64, clip 6."""
    bpt_paper_sizes(args)
    bpt_lm(args)


register_model_architecture("bpt_lm", "bpt_lm_enwik8")(_bpt_paper_lm)
register_model_architecture("bpt_lm", "bpt_lm_text8")(_bpt_paper_lm)


@register_model_architecture("segtree_lm", "segtree_lm")
def segtree_lm(args):
    """fairseq's ``transformer_lm`` sizes with the SegTree graph (k 1, levels clipped at 4)."""
    graph_defaults(args, k=1, clip=SEGTREE_CLIP)
    base_lm_architecture(args)


def segtree_paper_sizes(args):
    """SegTree paper section 3.1 (PTB and WikiText-2 alike): embedding and hidden size 320, FFN
    1024, tied input/output embeddings, 6 layers (the tables run 3-6), dropout 0.5 on the
    embeddings and before the output projection and 0.1 inside. Heads are not given: 8 (head
    dim 40) is ours. (Also the sizes of Table 1's transformer.)"""
    args.decoder_layers = safe_getattr(args, "decoder_layers", 6)
    args.decoder_embed_dim = safe_getattr(args, "decoder_embed_dim", 320)
    args.decoder_ffn_embed_dim = safe_getattr(args, "decoder_ffn_embed_dim", 1024)
    args.decoder_attention_heads = safe_getattr(args, "decoder_attention_heads", 8)
    args.share_decoder_input_output_embed = safe_getattr(args, "share_decoder_input_output_embed", True)
    args.dropout = safe_getattr(args, "dropout", 0.1)
    args.embed_dropout = safe_getattr(args, "embed_dropout", 0.5)
    args.output_dropout = safe_getattr(args, "output_dropout", 0.5)
    args.attention_dropout = safe_getattr(args, "attention_dropout", 0.1)


@register_model_architecture("segtree_lm", "segtree_lm_ptb")
def segtree_lm_ptb(args):
    """SegTree Table 1's sizes with the SegTree graph."""
    segtree_paper_sizes(args)
    segtree_lm(args)


register_model_architecture("segtree_lm", "segtree_lm_wikitext2")(segtree_lm_ptb)
