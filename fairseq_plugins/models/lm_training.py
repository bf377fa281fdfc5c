"""How the plugin's language models train, as the papers' code trained them: dropout on the
embeddings, inside the layers and before the output projection at separate rates (SegTree's and
BPT's ``dropouti``/``dropouth``/``dropoutc``), and BPT's post-norm layers with a layer norm on the
dropped-out embeddings. Every LM decoder of the plugin (``bpt_lm``, ``segtree_lm``, ``window_lm``
and the ``transformer_lm_matched`` baselines) takes these through ``LMTrainingDecoder``, so a
comparison can train both sides alike.

fairseq's ``--dropout`` stays the rate inside the layers; ``--embed-dropout`` (unset: ``--dropout``,
fairseq's embedding dropout) and ``--output-dropout`` (unset: 0, fairseq's transformer_lm has none)
are the other two.
"""

from dataclasses import dataclass, field
from typing import Optional

from fairseq.models.transformer_lm import TransformerLanguageModelConfig
from fairseq.modules import FairseqDropout, LayerNorm
from fairseq.utils import safe_getattr


@dataclass
class LMTrainingConfig(TransformerLanguageModelConfig):
    embed_dropout: Optional[float] = field(
        default=None, metadata={"help": "dropout on the token embeddings (SegTree's and BPT's dropouti); "
                                        "default: --dropout"})
    output_dropout: Optional[float] = field(
        default=None, metadata={"help": "dropout on the last layer's states before the output projection "
                                        "(SegTree's and BPT's dropoutc); default 0, as transformer_lm"})
    post_norm: Optional[bool] = field(
        default=None, metadata={"help": "layer norm after each sub-layer and on the dropped-out embeddings, "
                                        "no final norm (BPT's original modules/model.py); default pre-norm"})


@dataclass(frozen=True)
class LMTraining:
    """The resolved options: the rates as applied, and the norm placement."""

    embed_dropout: float
    output_dropout: float
    post_norm: bool


def lm_training(args, model: str) -> LMTraining:
    """Resolve the options of ``args`` for ``model`` and set fairseq's norm options to match:
    post-norm layers (``decoder_normalize_before`` off, which ``base_lm_architecture`` forces on)."""
    dropout = safe_getattr(args, "dropout", 0.1)
    embed = safe_getattr(args, "embed_dropout", None)
    output = safe_getattr(args, "output_dropout", None)
    training = LMTraining(dropout if embed is None else embed, 0.0 if output is None else output,
                          bool(safe_getattr(args, "post_norm", False)))
    for name in ("embed_dropout", "output_dropout"):
        if not 0.0 <= getattr(training, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(training, name)} of {model}: "
                             "give a rate in [0, 1]")
    if training.post_norm:
        if safe_getattr(args, "layernorm_embedding", False):
            raise ValueError(f"{model}: --post-norm has its own embedding layer norm; drop --layernorm-embedding")
        args.decoder_normalize_before = False
    return training


class EmbeddingDropout(FairseqDropout):
    """The embedding dropout, then the embedding layer norm of post-norm (``norm``, else none):
    BPT's original normalises the dropped-out embeddings (``norm(emb_dropout(h))``), where
    fairseq's ``--layernorm-embedding`` drops out the normalised ones."""

    def __init__(self, p: float, norm: Optional[LayerNorm]):
        super().__init__(p, module_name="EmbeddingDropout")
        self.norm = norm

    def forward(self, x, inplace: bool = False):
        x = super().forward(x, inplace=inplace)
        return x if self.norm is None else self.norm(x)


class LMTrainingDecoder:
    """Mixin before a fairseq ``TransformerDecoderBase`` of a language model: its embedding
    dropout (fairseq's ``dropout_module``, which the decoder applies to the embeddings only)
    becomes ``EmbeddingDropout``, ``output_layer`` drops out its input first, and the decoder keeps
    the update count for the criteria that schedule on it (``aux_layer_cross_entropy``)."""

    def __init__(self, training: LMTraining, *args, **kwargs):
        super().__init__(*args, **kwargs)
        norm = LayerNorm(self.embed_dim) if training.post_norm else None
        self.dropout_module = EmbeddingDropout(training.embed_dropout, norm)
        self.output_dropout = FairseqDropout(training.output_dropout, module_name="OutputDropout")
        self.num_updates = 0

    def set_num_updates(self, num_updates):
        self.num_updates = num_updates

    def output_layer(self, features):
        return super().output_layer(self.output_dropout(features))

    def layer_output(self, state):
        """The logits a layer's token states (``inner_states[l]``, T x B x C) give through the
        decoder's final norm (pre-norm), output projections and output dropout: the last layer's
        are the model's output."""
        x = state if self.layer_norm is None else self.layer_norm(state)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return self.output_layer(x)
