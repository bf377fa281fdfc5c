"""Classifiers over sentence vectors or over every token: the papers' one- and two-layer heads.

BPT's original classifier is dropout then one linear layer; the Multi-Scale Transformer's is a
two-layer MLP. A head maps [..., D] to [..., classes] and so serves a sentence ([B x D]) as well
as a tagger's tokens ([B x T x D]). A tagger's head may carry a linear-chain CRF over its
outputs (``crf``): its logits are then the CRF's emissions, trained and decoded by the CRF.
"""

from fairseq import utils
from torch import nn

from fairseq_plugins.modules.common.linear_crf import LinearChainCRF


class ClassificationHead(nn.Module):
    def __init__(self, input_dim: int, inner_dim: int, num_classes: int, layers: int,
                 activation_fn: str, dropout: float, token_level: bool = False, crf: bool = False):
        super().__init__()
        if layers not in (1, 2):
            raise ValueError(f"--classifier-layers must be 1 or 2, got {layers}")
        self.token_level = token_level  # a tagger's head: applied to each token's state
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(input_dim, inner_dim) if layers == 2 else None
        self.activation_fn = utils.get_activation_fn(activation_fn)
        self.out_proj = nn.Linear(inner_dim if layers == 2 else input_dim, num_classes)
        if crf and not token_level:
            raise ValueError("--crf is a tagger's output layer: use it with --task sequence_tagging")
        self.crf = LinearChainCRF(num_classes) if crf else None

    def forward(self, features):
        x = self.dropout(features)
        if self.dense is not None:
            x = self.dropout(self.activation_fn(self.dense(x)))
        return self.out_proj(x)

    def predict_tags(self, logits, words):
        """A tagger's tag for each word [B x T] from this head's logits: the CRF's Viterbi path, or
        without a CRF each word's best tag; ``words`` [B x T] marks the words (first in every row)."""
        if self.crf is None:
            return logits.argmax(-1)
        return self.crf.decode(logits.float(), words)[0]
