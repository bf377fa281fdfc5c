"""How many heads of each scale every layer gets (paper Sec. "Control Factor of Scale
Distributions", Eq. 11-12).

The printed formula is garbled in every copy of the paper.  What survives is: scores
``z^l_k`` over the ``|Omega|`` candidate scales (smallest first), ``z^l_k = 0`` when
``l = L`` or ``k = |Omega|``, otherwise ``z^l_{k+1} + alpha`` divided by something of
``l``; ``n^l = softmax(z^l) * N'``; and one worked example (alpha = 0.5, N' = 10 heads,
L = 3 layers, 5 scales): {5,2,2,1,0}, {4,2,2,1,1}, {2,2,2,2,2}.

Our reading, the one that reproduces that example exactly:

* ``z^l_k = alpha * (|Omega| - k) / l`` for ``l < L`` and ``0`` for the top layer, i.e.
  ``z^l_k = z^l_{k+1} + alpha / l``: a lower layer prefers small scales more strongly
  (alpha > 0) or large ones (alpha < 0); the top layer is uniform.
* shares ``p = softmax(z^l)`` become integer head counts by cumulative rounding from the
  smallest scale: ``n_k = ceil(N' * (p_1 + ... + p_k)) - ceil(N' * (p_1 + ... + p_{k-1}))``.
  Counts always sum to N'.  Plain rounding, floor plus largest remainder and cumulative
  floor/nearest all miss the example (e.g. layer 1 becomes {4,3,1,1,1} or {4,2,2,1,1}).

With L = 3, ``alpha / l`` equals ``alpha * (L - l) / (L - 1)``, the other reading of the
garbled text; for deeper models they differ and we follow ``alpha / l``.
"""

import math
from typing import List, Sequence

import torch

from .multiscale_attention import Scale, parse_scales

PAPER_CANDIDATES = "1,3,N/16,N/8,N/4"
"""The candidate scales of the paper's text-classification and SNLI experiments."""

PAPER_EXAMPLE = "paper-example"
"""Preset name: the worked example (alpha 0.5, 10 heads, 3 layers) over PAPER_CANDIDATES."""

PAPER_EXAMPLE_COUNTS = ((5, 2, 2, 1, 0), (4, 2, 2, 1, 1), (2, 2, 2, 2, 2))


def alpha_head_counts(
    alpha: float, num_heads: int, num_layers: int, num_scales: int
) -> List[List[int]]:
    """Heads per candidate scale for every layer (bottom first), by the alpha rule."""
    if num_heads < 1 or num_layers < 1 or num_scales < 1:
        raise ValueError("num_heads, num_layers and num_scales must be positive")
    counts = []
    for layer in range(1, num_layers + 1):
        step = 0.0 if layer == num_layers else alpha / layer
        scores = torch.tensor(
            [step * (num_scales - k) for k in range(1, num_scales + 1)], dtype=torch.float64
        )
        cumulative = torch.softmax(scores, dim=0).cumsum(dim=0) * num_heads
        # ceil with a tolerance: shares that are integers up to rounding stay integers
        bounds = [0] + [math.ceil(float(c) - 1e-9) for c in cumulative]
        bounds[-1] = num_heads
        counts.append([bounds[k + 1] - bounds[k] for k in range(num_scales)])
    return counts


def expand_counts(counts: Sequence[int], candidates: Sequence[Scale]) -> List[Scale]:
    """Per-head scales from head counts, e.g. (2, 1) over [1, 3] -> [1, 1, 3]."""
    if len(counts) != len(candidates):
        raise ValueError(f"{len(counts)} counts for {len(candidates)} candidate scales")
    return [scale for scale, count in zip(candidates, counts) for _ in range(count)]


def layer_scales(
    spec: str, num_heads: int, num_layers: int, alpha: float, candidates: str
) -> List[List[Scale]]:
    """Per-layer, per-head scales from a command-line ``spec``:

    * ``""`` (empty): the alpha rule over ``candidates``;
    * ``"paper-example"``: the paper's worked example (needs 10 heads and 3 layers);
    * explicit lists, one per layer separated by ``|`` (a single list is used for every
      layer), each a comma-separated list of ``num_heads`` scales:
      ``"1,1,3,3|3,3,N/4,all"``.
    """
    candidate_scales = parse_scales(candidates)
    if spec == PAPER_EXAMPLE:
        if (num_heads, num_layers) != (10, 3):
            raise ValueError(
                f"the paper-example preset is for 10 heads and 3 layers, not "
                f"{num_heads} heads and {num_layers} layers"
            )
        paper = parse_scales(PAPER_CANDIDATES)
        return [expand_counts(counts, paper) for counts in PAPER_EXAMPLE_COUNTS]
    if not spec:
        return [
            expand_counts(counts, candidate_scales)
            for counts in alpha_head_counts(alpha, num_heads, num_layers, len(candidate_scales))
        ]
    layers = [parse_scales(part) for part in spec.split("|")]
    if len(layers) == 1:
        layers = layers * num_layers
    if len(layers) != num_layers:
        raise ValueError(f"{len(layers)} scale lists for {num_layers} layers in {spec!r}")
    for index, scales in enumerate(layers):
        if len(scales) != num_heads:
            raise ValueError(
                f"layer {index + 1} lists {len(scales)} scales for {num_heads} heads in {spec!r}"
            )
    return layers
