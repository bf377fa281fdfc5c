"""fairseq's transformer encoder as a sentence classifier or tagger: the papers' baseline."""

from dataclasses import dataclass

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerEncoderBase

from fairseq_plugins.models.model_options import PluginTransformerConfig
from fairseq_plugins.models.sentence_defaults import classifier_defaults
from fairseq_plugins.models.sentence_encoder_model import ClassifierOptions, SentenceEncoderModel


@dataclass
class TransformerClassifierConfig(PluginTransformerConfig, ClassifierOptions):
    """fairseq's transformer options plus the classifier's."""


@register_model("transformer_classifier")
class TransformerClassifierModel(SentenceEncoderModel):
    config_class = TransformerClassifierConfig

    @classmethod
    def build_encoder(cls, cfg, dictionary, embed_tokens):
        return TransformerEncoderBase(cfg, dictionary, embed_tokens)


@register_model_architecture("transformer_classifier", "transformer_classifier")
def transformer_classifier(args):
    """The baseline at the papers' classification size: d 300, FFN 600, 6 heads, 4 layers."""
    classifier_defaults(args, TransformerClassifierConfig, sentence_readout="cls-max")

