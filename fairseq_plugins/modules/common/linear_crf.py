"""A linear-chain CRF over a tagger's per-word scores (the Multi-Scale paper's "+ CRF" rows).

A tag sequence y_1..y_n of a sentence with emissions E (the head's logits) scores
``start[y_1] + sum_t E[t, y_t] + sum_t transitions[y_t, y_t+1] + end[y_n]``; training minimizes
``log Z - score(gold)`` (the forward algorithm in log space) and prediction takes the Viterbi
path. Written here because no maintained PyTorch library provides one (pytorch-crf and
torch-struct have had no release since 2019 and 2021; AllenNLP's is archived). Batched: a mask
[B x T] marks each row's words, which must come first in the row (right padding); a row
without words has log Z and score 0 and an empty path. The sums run in the wider of the
emissions' and the parameters' types (float32 emissions under ``--fp16``'s half parameters).
"""

from typing import Tuple

import torch
from torch import nn


class LinearChainCRF(nn.Module):
    def __init__(self, num_tags: int):
        super().__init__()
        self.transitions = nn.Parameter(torch.zeros(num_tags, num_tags))  # [from, to]
        self.start = nn.Parameter(torch.zeros(num_tags))
        self.end = nn.Parameter(torch.zeros(num_tags))

    def _check(self, emissions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if emissions.dim() != 3 or emissions.size(-1) != self.start.numel() or mask.shape != emissions.shape[:2]:
            raise ValueError(f"emissions must be [B x T x {self.start.numel()}] and the mask [B x T]; got "
                             f"{tuple(emissions.shape)} and {tuple(mask.shape)}")
        mask = mask.bool()
        if mask[:, 1:].gt(mask[:, :-1]).any():
            raise ValueError("the CRF's mask must mark each row's words first, then padding (right-padded rows)")
        return mask

    def log_partition(self, emissions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """log Z of every row [B]: logsumexp of the scores of all tag sequences of its length."""
        mask = self._check(emissions, mask)
        transitions, start, end = self.transitions, self.start, self.end
        alpha = start + emissions[:, 0]  # [B x K]: log-sum of the paths ending in each tag
        for t in range(1, emissions.size(1)):
            step = torch.logsumexp(alpha.unsqueeze(2) + transitions, dim=1) + emissions[:, t]
            alpha = torch.where(mask[:, t, None], step, alpha)
        return torch.logsumexp(alpha + end, dim=1).masked_fill(~mask[:, 0], 0.0)

    def score(self, emissions: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The score [B] of the tag sequence ``tags`` [B x T] (positions outside the mask ignored)."""
        mask = self._check(emissions, mask)
        transitions, start, end = self.transitions, self.start, self.end
        tags = tags.masked_fill(~mask, 0)
        weights = mask.to(emissions.dtype)
        emitted = emissions.gather(2, tags.unsqueeze(2)).squeeze(2)
        total = start[tags[:, 0]] + (emitted * weights).sum(1)
        total = total + (transitions[tags[:, :-1], tags[:, 1:]] * weights[:, 1:]).sum(1)
        last = tags.gather(1, (mask.sum(1) - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        return (total + end[last]) * weights[:, 0]

    def forward(self, emissions: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The negative log-likelihood of ``tags`` for every row [B]: log Z - score(tags)."""
        return self.log_partition(emissions, mask) - self.score(emissions, tags, mask)

    def decode(self, emissions: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Viterbi: the best tag sequence of every row [B x T] (-1 outside the mask) and its score [B]."""
        mask = self._check(emissions, mask)
        transitions, start, end = self.transitions, self.start, self.end
        best = start + emissions[:, 0]
        back = []  # back[t - 1][b, k]: the best tag before tag k at position t
        for t in range(1, emissions.size(1)):
            step, previous = (best.unsqueeze(2) + transitions).max(dim=1)
            best = torch.where(mask[:, t, None], step + emissions[:, t], best)
            back.append(previous)
        score, current = (best + end).max(dim=1)
        last = mask.sum(1) - 1
        path = torch.full(mask.shape, -1, dtype=torch.long, device=emissions.device)
        follow = current
        for t in range(emissions.size(1) - 1, -1, -1):
            follow = torch.where(last == t, current, follow)  # a row's path starts at its last word
            path[:, t] = follow
            if t > 0:
                follow = back[t - 1].gather(1, follow.unsqueeze(1)).squeeze(1)
        return path.masked_fill(~mask, -1), score.masked_fill(~mask[:, 0], 0.0)
