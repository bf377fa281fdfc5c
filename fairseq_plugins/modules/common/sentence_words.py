"""A sentence's words without the ``<s>`` and ``</s>`` that fairseq's data adds around them.

fairseq's ``sentence_prediction`` rows are ``<s> words </s>`` (``--init-token``, then the
``</s>`` that binarization appends). BPT's and SegTree's original classifiers build their trees
over the words alone (torchtext fields without init or end tokens); ``words_only`` gives a tree
encoder those rows.
"""

import torch
from torch import Tensor


def words_only(tokens: Tensor, bos: int, eos: int, pad: int) -> Tensor:
    """[B x T] rows (padded on either side) -> their tokens other than ``bos``/``eos``, in order,
    right-padded to the longest remaining row."""
    keep = tokens.ne(pad) & tokens.ne(bos) & tokens.ne(eos)
    lengths = keep.sum(1)
    if bool((lengths == 0).any()):
        raise ValueError("a sentence has no tokens besides <s> and </s>: there is nothing to encode")
    order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # kept tokens first, in order
    width = int(lengths.max())
    kept = tokens.gather(1, order)[:, :width]
    beyond = torch.arange(width, device=tokens.device).unsqueeze(0) >= lengths.unsqueeze(1)
    return kept.masked_fill(beyond, pad)
