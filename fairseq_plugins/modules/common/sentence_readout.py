"""Sentence vectors from an encoder's states: each paper's readout, one function each.

BPT and SegTree read the root node of the tree (their papers, and BPT's original code: the
root's state after the last layer); the Multi-Scale Transformer joins a classification node
prepended to the sentence ([CLS]) and a max-pooling over all its nodes (its Eq. 10 section,
"Classification node": here the two are concatenated); ``cls`` is RoBERTa's first token,
``max`` and ``mean`` pool the tokens. Padding never reaches a pooled value.
"""

from typing import Optional

import torch
from torch import Tensor

READOUTS = ("root", "cls-max", "cls", "max", "mean")


def readout_dim(name: str, embed_dim: int) -> int:
    """Width of the sentence vector ``name`` gives over ``embed_dim`` states."""
    return 2 * embed_dim if name == "cls-max" else embed_dim


def sentence_vector(name: str, tokens: Tensor, padding: Optional[Tensor], root: Optional[Tensor] = None) -> Tensor:
    """[B x D] from token states ``tokens`` [T x B x C] (fairseq's time-first layout), the padding
    mask [B x T] (True at padding; right-padded) and, for ``root``, the root states [B x C]."""
    if name == "root":
        if root is None:
            raise ValueError("the 'root' readout needs an encoder with a tree (BPT, SegTree)")
        return root
    states = tokens.transpose(0, 1)  # B x T x C
    pad = torch.zeros(states.shape[:2], dtype=torch.bool, device=states.device) if padding is None else padding
    if name == "cls":
        return states[:, 0]
    if name == "mean":
        keep = (~pad).unsqueeze(-1).type_as(states)
        return (states * keep).sum(1) / keep.sum(1).clamp_min(1)
    pooled = states.masked_fill(pad.unsqueeze(-1), float("-inf")).max(1).values
    if name == "max":
        return pooled
    if name == "cls-max":
        return torch.cat([states[:, 0], pooled], -1)
    raise ValueError(f"unknown readout {name!r}: choose from {', '.join(READOUTS)}")
