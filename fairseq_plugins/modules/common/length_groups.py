"""Run TranSFormer's fast branch as a few sub-batches of similar length.

fairseq batches sentences by their subword length, but the number of characters of
sentences with the same number of subwords still varies a lot, and a batch that is not
sorted (the benchmark's, a validation batch) even more: padded to the longest sentence,
half of the fast branch's units can be padding, and its self-attention pays for the
padding squared. Sorting the sentences by character length and running the fast branch
on up to four groups, each trimmed to its own longest sentence, gives every sentence the
same result (nothing in the fast branch mixes sentences) for a fraction of the work.
The slow branch is not split: it reads the fast states put back into one padded batch.
"""

from typing import List, Optional, Sequence, Tuple

import torch


def length_groups(
    padding_mask: torch.Tensor, max_groups: int = 4, min_saving: float = 0.2
) -> List[Tuple[Optional[torch.Tensor], int]]:
    """(batch positions, trimmed length) of each group of a right-padded batch
    (``padding_mask`` B x L); one group ``(None, L)``, the batch as it is, unless
    splitting into ``max_groups`` equal-sized groups of sorted length removes at least
    ``min_saving`` of the padded units. A left-padded batch is never split."""
    bsz, length = padding_mask.shape
    whole = [(None, length)]
    if max_groups < 2 or bsz < 2 * max_groups or padding_mask[:, 0].any():
        return whole
    sorted_lengths, order = (~padding_mask).sum(1).sort()
    groups = [
        (index, int(lengths[-1]))
        for index, lengths in zip(order.tensor_split(max_groups), sorted_lengths.tensor_split(max_groups))
    ]
    if sum(len(index) * size for index, size in groups) > (1 - min_saving) * bsz * length:
        return whole
    return groups


def take(x: torch.Tensor, index: Optional[torch.Tensor], length: Optional[int] = None, time_first: bool = False):
    """The rows ``index`` (None: all) of a batch, trimmed to ``length`` positions."""
    if x is None:
        return None
    if time_first:
        x = x.transpose(0, 1)
    if index is not None:
        x = x[index]
    if length is not None:
        x = x[:, :length]
    return x.transpose(0, 1) if time_first else x


def merge(parts: Sequence[torch.Tensor], indices: Sequence[Optional[torch.Tensor]], length: int) -> torch.Tensor:
    """Time-first group outputs (Lg x Bg x C, batch positions ``indices``) back into one
    zero-padded L x B x C batch."""
    if len(parts) == 1 and indices[0] is None:
        return parts[0]
    bsz = sum(part.size(1) for part in parts)
    out = parts[0].new_zeros(length, bsz, parts[0].size(2))
    for part, index in zip(parts, indices):
        out[: part.size(0), index] = part
    return out
