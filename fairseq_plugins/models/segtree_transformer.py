"""SegTree Transformer (Ye et al., 2019) for translation.

The BPT model with the SegTree graph: each token attends to itself, its two neighbours and the
minimal set of tree nodes covering the rest of the sentence (decoder: the left part only);
span nodes attend to their tokens and themselves. Its k is 1 by definition (``--graph-k`` other
than 1 is an error).
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer.transformer_legacy import base_architecture, transformer_iwslt_de_en

from fairseq_plugins.models.bpt_transformer import BPTTransformerModel, graph_defaults


@register_model("segtree_transformer")
class SegTreeTransformerModel(BPTTransformerModel):
    graph_kind = "segtree"


@register_model_architecture("segtree_transformer", "segtree_transformer")
def segtree_transformer(args):
    graph_defaults(args, k=1, clip=4)
    base_architecture(args)


@register_model_architecture("segtree_transformer", "segtree_transformer_iwslt_de_en")
def segtree_transformer_iwslt_de_en(args):
    graph_defaults(args, k=1, clip=4)
    transformer_iwslt_de_en(args)
