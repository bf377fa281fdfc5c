"""``transformer_lm`` as the baseline of the plugin's language models: the same size and norm
placement.

fairseq's ``--arch transformer_lm`` takes its dataclass defaults for what the command line
leaves out: 512-d input and output projections whatever ``--decoder-embed-dim`` is, and
post-norm layers, where ``bpt_lm``, ``segtree_lm`` and ``window_lm`` (through fairseq's
``base_lm_architecture``) project at the embedding size and normalise before each sub-layer.
These architectures do the same, so that a comparison differs only in the attention:
``transformer_lm_matched`` fills every option left out as the plugin LMs do (sizes from the
flags), ``transformer_lm_segtree_ptb`` / ``_wikitext2`` with SegTree Table 1's sizes.
"""

from fairseq.models import register_model_architecture
from fairseq.models.transformer_lm import base_lm_architecture

from fairseq_plugins.models.bpt_lm import segtree_paper_sizes


@register_model_architecture("transformer_lm", "transformer_lm_matched")
def transformer_lm_matched(args):
    """Input and output dims = ``--decoder-embed-dim``, pre-norm, the other defaults fairseq's."""
    base_lm_architecture(args)


@register_model_architecture("transformer_lm", "transformer_lm_segtree_ptb")
def transformer_lm_segtree_ptb(args):
    """SegTree Table 1's transformer: ``segtree_lm_ptb``'s sizes."""
    segtree_paper_sizes(args)
    base_lm_architecture(args)


register_model_architecture("transformer_lm", "transformer_lm_segtree_wikitext2")(transformer_lm_segtree_ptb)
