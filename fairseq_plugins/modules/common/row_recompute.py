"""A sublayer whose inner activations are recomputed in the backward, a chunk of rows at a time.

A transformer FFN saves its widest tensors for the backward: the layer norm's output and the
hidden states (4 d per row: a third of what a pre-norm layer saves, and more in graph layers
whose span nodes double the rows). ``recompute_rows(fn, x, width)`` runs a row-wise ``fn``
over chunks of ``x``'s rows, each under torch's non-reentrant checkpoint: the forward keeps
only the chunks' inputs, and the backward reruns one chunk's ``fn`` at a time (early stop: up
to the last tensor its gradient needs, for an FFN its second product is not rerun), so the
hidden states of one chunk are ever alive instead of every row's. Dropout masks are redrawn
from the RNG state each chunk started with (``preserve_rng_state``), hence equal the forward's.
"""

from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# the widest inner tensor of one chunk, in elements (16 MB in fp32): products of at least
# ~1,000 rows for widths up to 4,096, large enough to keep a CPU's or GPU's GEMM efficient
CHUNK_ELEMENTS = 2 ** 22


def chunk_rows(x: Tensor, width: int) -> int:
    """Rows of ``x`` ([rows, ...]) per chunk whose widest inner tensor has ``width`` per element
    of a row's trailing dims divided by the last (e.g. an FFN's hidden size)."""
    per_row = x[0].numel() // x.size(-1) * width
    return max(1, CHUNK_ELEMENTS // max(1, per_row))


def recompute_rows(fn: Callable[[Tensor], Tensor], x: Tensor, width: int) -> Tensor:
    """``fn(x)`` for a row-wise ``fn`` ([rows, ...] -> [rows, ...]), its inner activations
    recomputed in the backward chunk by chunk (see the module's docstring); without gradients
    it is ``fn(x)``."""
    if not torch.is_grad_enabled():
        return fn(x)
    outputs = [checkpoint(fn, chunk, use_reentrant=False) for chunk in x.split(chunk_rows(x, width))]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
