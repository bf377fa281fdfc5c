"""``transformer_lm`` as the baseline of the plugin's language models: the same size, norm
placement and training options.

fairseq's ``--arch transformer_lm`` takes its dataclass defaults for what the command line
leaves out: 512-d input and output projections whatever ``--decoder-embed-dim`` is, and
post-norm layers, where ``bpt_lm``, ``segtree_lm`` and ``window_lm`` (through fairseq's
``base_lm_architecture``) project at the embedding size and normalise before each sub-layer.
These architectures do the same, so that a comparison differs only in the attention:
``transformer_lm_matched`` fills every option left out as the plugin LMs do (sizes from the
flags), ``transformer_lm_segtree_ptb`` / ``_wikitext2`` with SegTree Table 1's sizes. Their
model is fairseq's ``transformer_lm`` with the plugin LMs' training options
(``--embed-dropout``, ``--output-dropout``, ``--post-norm``: ``models/lm_training.py``), which the
stock model cannot take.
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoder
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture

from fairseq_plugins.models.bpt_lm import segtree_paper_sizes
from fairseq_plugins.models.lm_training import LMTrainingConfig, LMTrainingDecoder, lm_training
from fairseq_plugins.models.model_options import add_config_args, check_lm_context, lm_max_positions
from fairseq_plugins.models.plugin_model import PluginModel


class MatchedTransformerDecoder(LMTrainingDecoder, TransformerDecoder):
    """fairseq's decoder with the LM training options."""


@register_model("transformer_lm_matched")
class MatchedTransformerLanguageModel(PluginModel, TransformerLanguageModel):
    """fairseq's ``transformer_lm`` over plain token embeddings, with the LM training options."""

    language_model = True
    lm_name = "transformer_lm_matched"
    config = LMTrainingConfig

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, cls.config)

    @classmethod
    def build_model(cls, args, task):
        cls.check_task(args, task)
        if getattr(args, "character_embeddings", False) or getattr(args, "adaptive_input", False):
            raise ValueError(f"{cls.lm_name} takes plain token embeddings (no --character-embeddings/--adaptive-input)")
        lm_max_positions(args, cls.lm_name)
        check_lm_context(args, task, cls.lm_name)
        training = lm_training(args, cls.lm_name)
        embed_tokens = cls.build_embedding(args, task.source_dictionary, args.decoder_input_dim)
        return cls(cls.build_lm_decoder(training, args, task.target_dictionary, embed_tokens))

    @classmethod
    def build_lm_decoder(cls, training, args, dictionary, embed_tokens):
        return MatchedTransformerDecoder(training, args, dictionary, embed_tokens, no_encoder_attn=True)


@register_model_architecture("transformer_lm_matched", "transformer_lm_matched")
def transformer_lm_matched(args):
    """Input and output dims = ``--decoder-embed-dim``, pre-norm, the other defaults fairseq's."""
    base_lm_architecture(args)


@register_model_architecture("transformer_lm_matched", "transformer_lm_segtree_ptb")
def transformer_lm_segtree_ptb(args):
    """SegTree Table 1's transformer: ``segtree_lm_ptb``'s sizes."""
    segtree_paper_sizes(args)
    base_lm_architecture(args)


register_model_architecture("transformer_lm_matched", "transformer_lm_segtree_wikitext2")(transformer_lm_segtree_ptb)
