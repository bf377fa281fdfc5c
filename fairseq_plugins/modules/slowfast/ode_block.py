"""The ODE Transformer's second-order Runge-Kutta block (Li et al., 2022, "ODE Transformer: An
Ordinary Differential Equation-Inspired Model for Sequence Generation"), for TranSFormer's
"+ ODE" row (its Table 1).

A residual block ``y + F(y)`` is one Euler step of ``dy/dt = F(y)``. The RK2 block calls the
same block (same parameters) twice and combines the two slopes:

    F1 = F(y),  F2 = F(y + F1),  y' = y + (F1 + F2) / 2                    (rk2)
    y' = y + g * F1 + (1 - g) * F2,  g = sigmoid(W [F1; F2] + b)           (rk2-gated)

``F`` is the whole encoder block without its outer residual: every sublayer (word GCN,
self-attention, cross-granularity fusion, FFN) with its own residual and norm, so
``F(y) = block(y) - y``. The state is a list of tensors (TranSFormer's slow branch and the
length groups of its fast branch) advanced together, since the branches read each other
inside a block.
"""

from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

ODE_SOLVERS = ("euler", "rk2", "rk2-gated")
State = List[torch.Tensor]


class RK2Gate(nn.Module):
    """The learnable coefficient of the gated RK2 block: ``g = sigmoid(W [F1; F2] + b)``, one
    scalar per position (the ODE Transformer's ``gate_linear``, one per encoder)."""

    def __init__(self, embed_dim: int):
        super().__init__()
        self.linear = nn.Linear(2 * embed_dim, 1)
        nn.init.xavier_uniform_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, f1: torch.Tensor, f2: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear(torch.cat([f1, f2], dim=-1)))


def rk2_step(block: Callable[[State], State], y: Sequence[torch.Tensor],
             gates: Optional[Sequence[Optional[nn.Module]]] = None) -> State:
    """One RK2 step of ``block`` (a residual map ``y -> y + F(y)``) from ``y``; ``gates[i]``
    (an ``RK2Gate``) makes tensor i's coefficients learnable, ``None`` keeps 1/2 and 1/2."""
    y = list(y)
    f1 = [out - x for out, x in zip(block(y), y)]
    f2 = [out - x - d for out, x, d in zip(block([x + d for x, d in zip(y, f1)]), y, f1)]
    gates = gates or [None] * len(y)
    result = []
    for x, a, b, gate in zip(y, f1, f2, gates):
        if gate is None:
            result.append(x + 0.5 * (a + b))
        else:
            g = gate(a, b)
            result.append(x + g * a + (1 - g) * b)
    return result
