"""BPT and SegTree encoders as sentence classifiers and taggers, read at the tree's root.

Both papers take "the representation of the root node in the final layer" for text
classification (BPT sec. 3, SegTree sec. 2; BPT's original code reads the root too, through
dropout and one linear layer). The encoder is the translation model's
(:class:`~fairseq_plugins.modules.bpt.graph_transformer.GraphTransformerEncoder`), tokens without
absolute positions (order from the tree's relative positions), as in the papers.
"""

from dataclasses import dataclass

from fairseq.models import register_model, register_model_architecture

from fairseq_plugins.models.bpt_transformer import GraphTransformerConfig, validate_graph_options
from fairseq_plugins.models.sentence_defaults import classifier_defaults
from fairseq_plugins.models.sentence_encoder_model import ClassifierOptions, SentenceEncoderModel
from fairseq_plugins.modules.bpt.graph_transformer import GraphTransformerEncoder


@dataclass
class GraphClassifierConfig(GraphTransformerConfig, ClassifierOptions):
    """The tree-graph encoder's options plus the classifier's."""


@register_model("bpt_classifier")
class BPTClassifierModel(SentenceEncoderModel):
    config_class = GraphClassifierConfig
    graph_kind = "bpt"

    @classmethod
    def check_options(cls, cfg):
        cfg.graph_kind = cls.graph_kind
        cfg.graph_sides = "encoder"
        validate_graph_options(cfg)

    @classmethod
    def build_encoder(cls, cfg, dictionary, embed_tokens):
        return GraphTransformerEncoder(cfg, dictionary, embed_tokens)


@register_model("segtree_classifier")
class SegTreeClassifierModel(BPTClassifierModel):
    graph_kind = "segtree"


def _graph_classifier(args, **values):
    classifier_defaults(args, GraphClassifierConfig, sentence_readout="root", classifier_layers=1, **values)


@register_model_architecture("bpt_classifier", "bpt_classifier")
def bpt_classifier(args):
    """BPT Table 8, SST: 4 layers, d 300, FFN 600, 6 heads, k 2, level clip 2 (``sst5-2.yml``)."""
    _graph_classifier(args, graph_k=2, graph_rel_clip=2)


@register_model_architecture("bpt_classifier", "bpt_classifier_imdb")
def bpt_classifier_imdb(args):
    """BPT Table 8, IMDB: 5 layers, k 4, level clip 5 (``imdb-4.yml``)."""
    _graph_classifier(args, graph_k=4, graph_rel_clip=5, encoder_layers=5)


@register_model_architecture("segtree_classifier", "segtree_classifier")
def segtree_classifier(args):
    """SegTree (k 1) at the classification size; level clip 2 is ours (SegTree's own graph clips no level)."""
    _graph_classifier(args, graph_k=1, graph_rel_clip=2)
