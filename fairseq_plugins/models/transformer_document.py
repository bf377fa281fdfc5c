"""``transformer_document``: fairseq's transformer with cross-attention restricted to the aligned
sentence of a document-level sample (``--task document_translation``).

Self-attention spans the whole sample, as in the stock transformer; only encoder-decoder
attention changes (see ``fairseq_plugins.modules.document.sentence_aligned_attention``). It separates the
effect of the aligned cross-attention from BPT's graph attention (``bpt_document``); the
paper's Transformer row is the stock ``transformer`` on the same samples.
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
    base_architecture,
)

from fairseq_plugins.models.plugin_model import PluginModel
from fairseq_plugins.modules.document.sentence_aligned_attention import (
    SentenceAlignedDecoderMixin,
    SourceTokensEncoderMixin,
)


class DocumentTransformerEncoder(SourceTokensEncoderMixin, TransformerEncoderBase):
    pass


class DocumentTransformerDecoder(SentenceAlignedDecoderMixin, TransformerDecoderBase):
    pass


@register_model("transformer_document")
class DocumentTransformerModel(PluginModel, TransformerModel):
    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return DocumentTransformerEncoder(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return DocumentTransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


@register_model_architecture("transformer_document", "transformer_document")
def transformer_document(args):
    base_architecture(args)
