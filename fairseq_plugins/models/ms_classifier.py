"""The Multi-Scale Transformer's classification encoder (Guo et al., 2019) as a classifier or tagger.

The paper's encoder layer: H <- LN(H + ReLU(MSMSA(H))) with no FFN and no absolute positions
(Eq. 10), scales per layer from the alpha rule, and a [CLS] node prepended to the sentence
(the task's ``--init-token``) joined with max-pooling over the last layer, read by a two-layer
MLP. The encoder is the translation model's
(:class:`~fairseq_plugins.modules.multiscale.multiscale_encoder_decoder.MultiScaleTransformerEncoder`).
"""

from dataclasses import dataclass

from fairseq.models import register_model, register_model_architecture

from fairseq_plugins.models.ms_transformer import MultiScaleTransformerConfig
from fairseq_plugins.models.sentence_defaults import classifier_defaults
from fairseq_plugins.models.sentence_encoder_model import ClassifierOptions, SentenceEncoderModel
from fairseq_plugins.modules.multiscale.multiscale_encoder_decoder import MultiScaleTransformerEncoder


@dataclass
class MultiScaleClassifierConfig(MultiScaleTransformerConfig, ClassifierOptions):
    """The multi-scale encoder's options plus the classifier's."""


@register_model("ms_classifier")
class MultiScaleClassifierModel(SentenceEncoderModel):
    config_class = MultiScaleClassifierConfig

    @classmethod
    def build_encoder(cls, cfg, dictionary, embed_tokens):
        return MultiScaleTransformerEncoder(cfg, dictionary, embed_tokens)


def _paper_encoder(args, **values):
    classifier_defaults(args, MultiScaleClassifierConfig, sentence_readout="cls-max", encoder_drop_ffn=True,
                        encoder_no_positions=True, **values)


@register_model_architecture("ms_classifier", "ms_classifier")
def ms_classifier(args):
    """Table 1, SST and MTL-16: d 300, 10 heads of 30, alpha 0.5, scales {1, 3, N/16, N/8, N/4}, 3 layers
    (the layer count of Table 6)."""
    _paper_encoder(args, encoder_embed_dim=300, encoder_attention_heads=10, encoder_layers=3,
                   encoder_scale_alpha=0.5)


@register_model_architecture("ms_classifier", "ms_classifier_snli")
def ms_classifier_snli(args):
    """Table 1, SNLI: d 600, 20 heads of 30, alpha 0.5; each sentence encoded alone, the head on
    [r1; r2; |r1 - r2|; r1 * r2] (the paper's sentence-vector setup, after Bowman et al., 2016)."""
    _paper_encoder(args, encoder_embed_dim=600, encoder_attention_heads=20, encoder_layers=3,
                   encoder_scale_alpha=0.5, pair_encoding="separate")


@register_model_architecture("ms_classifier", "ms_tagger")
def ms_tagger(args):
    """Table 1, sequence labelling: d 300, 10 heads of 30, alpha 1.0, scales {1, 3, 5, 7, 9}."""
    _paper_encoder(args, encoder_embed_dim=300, encoder_attention_heads=10, encoder_layers=3,
                   encoder_scale_alpha=1.0, scale_candidates="1,3,5,7,9")
