"""``bpt_document``: BP-Transformer for document-level translation (paper section 4.3.1).

Graph self-attention spans the whole sample (context sentences + current sentence) in the
encoder and, causally, in the decoder: that is ``bpt_transformer`` run on the samples of
``--task document_translation``. What changes is cross-attention, restricted to the aligned
sentence (``fairseq_plugins.modules.document.sentence_aligned_attention``). The BPT decoder's layers
carry span nodes as well as tokens; a span cross-attends like the last token it covers, the one
whose decoding step completes it, so full forward and incremental decoding agree.
"""

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer.transformer_legacy import base_architecture

from fairseq_plugins.graphs.binary_partition import node_levels
from fairseq_plugins.models.bpt_transformer import BPTTransformerModel, graph_defaults
from fairseq_plugins.models.transformer_document import DocumentTransformerDecoder, DocumentTransformerEncoder
from fairseq_plugins.modules.bpt.graph_transformer import GraphTransformerDecoder, GraphTransformerEncoder
from fairseq_plugins.modules.document.sentence_aligned_attention import SentenceAlignedDecoderMixin


class DocumentGraphDecoder(SentenceAlignedDecoderMixin, GraphTransformerDecoder):
    def cross_attention_rows(self, mask):
        """Token rows -> the rows of the nodes that cross-attend: the tokens themselves, or
        with ``--graph-cross-attention nodes`` tokens then spans level by level, where a span
        takes the row of the last token it covers."""
        if self.cross_attention_from == "tokens":
            return mask
        length = mask.size(1)
        level, index = node_levels(length)
        last_token = torch.clamp(((index + 1) << level) - 1, max=length - 1)
        return mask[:, last_token.to(mask.device)]


@register_model("bpt_document")
class BPTDocumentModel(BPTTransformerModel):
    """BPT whose cross-attention stays on the aligned sentence of a document-level sample."""

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        if cfg.graph_sides in ("encoder", "both"):
            return GraphTransformerEncoder(cfg, src_dict, embed_tokens)  # keeps src_tokens
        return DocumentTransformerEncoder(cfg, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        if cfg.graph_sides in ("decoder", "both"):
            return DocumentGraphDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)
        return DocumentTransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


@register_model_architecture("bpt_document", "bpt_document")
def bpt_document(args):
    """The paper's IWSLT15 Zh-En setting (Table 10: 6+6 layers, d 512, FFN 2048, 8 heads, i.e.
    transformer base); k 4 with the original IWSLT level clip 3."""
    graph_defaults(args, k=4, clip=3)
    base_architecture(args)
