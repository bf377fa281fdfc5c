"""``sparse_lm``: the Sparse Transformer's fixed strided attention (Child et al., 2019) as a
language model, BPT Figure 5's second baseline.

``bpt_lm``'s causal graph decoder with the graph ``graphs/strided.py`` builds instead of a tree:
token nodes only, each attending to its own block of ``--sparse-stride`` tokens (up to itself)
and to the last ``--sparse-summary`` tokens of every earlier block. The attention is the same
graph-attention op as BPT's; incremental decoding caches every token's keys/values and attends
over the cache with a decoding step's row of the same pattern. Token order comes from fairseq's
absolute sinusoidal positions (``--graph-token-positions absolute``): the graph has no
relative positions, as the original's Sparse Transformer config (``rel_pos: False``).
"""

from dataclasses import dataclass, field

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer_lm import base_lm_architecture
from fairseq.utils import safe_getattr

from fairseq_plugins.graphs.strided import DEFAULT_STRIDE, DEFAULT_SUMMARY
from fairseq_plugins.models.bpt_lm import BPTLanguageModel, bpt_paper_sizes
from fairseq_plugins.models.bpt_transformer import GraphTransformerConfig
from fairseq_plugins.models.lm_training import LMTrainingConfig
from fairseq_plugins.models.model_options import add_config_args, config_with_options


@dataclass
class StridedGraphConfig(GraphTransformerConfig):
    """The graph decoder's options plus the strided pattern's."""

    sparse_stride: int = field(default=DEFAULT_STRIDE, metadata={
        "help": "block length: a token attends to its block up to itself"})
    sparse_summary: int = field(default=DEFAULT_SUMMARY, metadata={
        "help": "summary tokens: the last c of every earlier block, which every later token attends to"})


# the options that mean something without a tree
SPARSE_LM_OPTIONS = ("sparse_stride", "sparse_summary", "graph_token_positions", "graph_attention_backend",
                     "graph_recompute_norms_ffn")
SparseLanguageModelConfig = config_with_options(
    "SparseLanguageModelConfig", LMTrainingConfig, StridedGraphConfig, SPARSE_LM_OPTIONS, __name__)


@register_model("sparse_lm")
class SparseLanguageModel(BPTLanguageModel):
    """``transformer_lm`` whose decoder attends over the Sparse Transformer's fixed pattern."""

    graph_kind = "sparse"
    graph_config = StridedGraphConfig

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, SparseLanguageModelConfig)


@register_model_architecture("sparse_lm", "sparse_lm")
def sparse_lm(args):
    """fairseq's ``transformer_lm`` sizes with Child et al.'s setting (stride 128, c 8) and
    absolute positions."""
    args.sparse_stride = safe_getattr(args, "sparse_stride", DEFAULT_STRIDE)
    args.sparse_summary = safe_getattr(args, "sparse_summary", DEFAULT_SUMMARY)
    args.graph_token_positions = safe_getattr(args, "graph_token_positions", "absolute")
    base_lm_architecture(args)


@register_model_architecture("sparse_lm", "sparse_lm_enwik8")
def sparse_lm_enwik8(args):
    """BPT Figure 5's Sparse Transformer: the sizes of ``bpt_lm_enwik8`` (BPT Table 9)."""
    bpt_paper_sizes(args)
    sparse_lm(args)
