"""Activations recomputed in the backward instead of saved: a row-wise sublayer's, a chunk of
rows at a time (``recompute_rows``), and layer norms' outputs (``recompute_norms``).

A transformer FFN saves its widest tensors for the backward: the layer norm's output and the
hidden states (4 d per row: a third of what a pre-norm layer saves, and more in graph layers
whose span nodes double the rows). ``recompute_rows(fn, x, width)`` runs a row-wise ``fn``
over chunks of ``x``'s rows, each under torch's non-reentrant checkpoint: the forward keeps
only the chunks' inputs, and the backward reruns one chunk's ``fn`` at a time (early stop: up
to the last tensor its gradient needs, for an FFN its second product is not rerun), so the
hidden states of one chunk are ever alive instead of every row's. Dropout masks are redrawn
from the RNG state each chunk started with (``preserve_rng_state``), hence equal the forward's.
"""

from functools import partial
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

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


# what ``recompute_norms`` recomputes: element-wise work over a row, cheap beside the products
NORM_OPS = (torch.ops.aten.native_layer_norm.default,)


def _recompute_only_norms(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Layer norms are recomputed, and views (a kept view would keep its base, the norm's
    output, alive): every other op's output is kept."""
    recompute = op in NORM_OPS or op.is_view
    return CheckpointPolicy.PREFER_RECOMPUTE if recompute else CheckpointPolicy.MUST_SAVE


def recompute_norms(fn: Callable[[Tensor], object], x: Tensor):
    """``fn(x)`` whose layer norms' outputs are recomputed in the backward (torch's selective
    checkpoint): every other op's output is kept as computed, so a layer norm feeding
    projections costs its own rerun and saves its output (the projections' saved input). The
    kept outputs must be what the caller keeps anyway (the projections' results): ``fn``
    should end at them. Without gradients it is ``fn(x)``."""
    if not torch.is_grad_enabled():
        return fn(x)
    return checkpoint(fn, x, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _recompute_only_norms))
