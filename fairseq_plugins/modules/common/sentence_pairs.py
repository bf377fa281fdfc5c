"""Sentence pairs encoded one sentence at a time, as sentence-vector models of NLI do.

fairseq's ``sentence_prediction`` task hands a pair over as one row,
``<s> premise </s> SEP hypothesis </s>`` (``--init-token``, ``--separator-token``). The
Multi-Scale paper (SNLI, after Bowman et al., 2016) encodes each sentence alone and classifies
``[r1; r2; |r1 - r2|; r1 * r2]``. ``split_pair`` cuts the row after its first ``</s>`` and gives
the hypothesis the row's first token in place of the separator, so each sentence reaches the
encoder exactly as a single sentence does (``<s> words </s>``).
"""

from typing import Tuple

import torch
from torch import Tensor


def split_pair(tokens: Tensor, eos: int, pad: int) -> Tuple[Tensor, Tensor]:
    """(first, second): right-padded [B x T1], [B x T2] from joined right-padded rows [B x T]."""
    batch, width = tokens.shape
    real = tokens.ne(pad)
    ends = tokens.eq(eos) & real
    if not bool(ends.any(1).all()):
        raise ValueError("a sentence pair row has no </s>: --pair-encoding separate needs the task's pair layout")
    len1 = ends.int().argmax(1) + 1  # up to and with the first </s>
    len2 = real.sum(1) - len1  # the separator (replaced below) and the second sentence with its </s>
    if bool((len2 < 2).any()):
        raise ValueError("--pair-encoding separate needs sentence pairs (input0 and input1, with --separator-token): "
                         "a row has nothing after its first </s>")
    pos = torch.arange(width, device=tokens.device).unsqueeze(0)
    first = torch.where(pos < len1.unsqueeze(1), tokens, pad)[:, : int(len1.max())]
    shifted = tokens.gather(1, (pos + len1.unsqueeze(1)).clamp(max=width - 1))
    second = torch.where(pos < len2.unsqueeze(1), shifted, pad)[:, : int(len2.max())].clone()
    second[:, 0] = tokens[:, 0]
    return first, second


def pair_features(r1: Tensor, r2: Tensor) -> Tensor:
    """[r1; r2; |r1 - r2|; r1 * r2]: the matching features of Bowman et al. (2016)."""
    return torch.cat([r1, r2, (r1 - r2).abs(), r1 * r2], -1)
