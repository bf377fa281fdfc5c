"""A fairseq search strategy that makes every hypothesis hold as many sentences as its source.

Decoding a chunk of several sentences (``--document-samples chunks``) must give one translation
per source sentence, or a hypothesis could not be split back onto the reference sentences. As in
the original BPT beam search (``modules/beam.py``, which counts ends of sentence up to the
number of source sentences), the separator ``<s>`` is forbidden once a hypothesis has as many
as its source, and ``</s>`` before that. Only the maximum length can still end a hypothesis
early (fairseq then allows nothing but ``</s>``).
"""

import math
from typing import Dict, Optional

import torch
from fairseq.search import Search
from torch import Tensor


class SentenceCountSearch(Search):
    """Wraps another fairseq search (beam, sampling, ...) and masks ``<s>``/``</s>`` before it."""

    def __init__(self, inner: Search, separator: int):
        torch.nn.Module.__init__(self)
        self.inner = inner
        self.separator, self.eos = separator, inner.eos
        self.supports_constraints = inner.supports_constraints
        self.stop_on_max_len = inner.stop_on_max_len
        self.needs_src_lengths = getattr(inner, "needs_src_lengths", False)
        self.separators: Dict[int, int] = {}

    def expect(self, ids: Tensor, separators: Tensor) -> None:
        """Sample id -> number of separators its hypotheses must hold (the next batch's)."""
        self.separators = dict(zip(ids.tolist(), separators.tolist()))

    def step(self, step: int, lprobs: Tensor, scores: Optional[Tensor],
             prev_output_tokens: Optional[Tensor] = None, original_batch_idxs: Optional[Tensor] = None):
        bsz, beam, _ = lprobs.size()
        wanted = torch.tensor([self.separators[i] for i in original_batch_idxs.tolist()], device=lprobs.device)
        emitted = prev_output_tokens[:, 1:].eq(self.separator).sum(dim=-1).view(bsz, beam)
        more = emitted < wanted.unsqueeze(-1)
        eos = lprobs[:, :, self.eos].clone()
        lprobs = lprobs.clone()
        lprobs[:, :, self.separator] = lprobs[:, :, self.separator].masked_fill(~more, -math.inf)
        lprobs[:, :, self.eos] = eos.masked_fill(more, -math.inf)
        # at the maximum length fairseq allows only </s>: keep it rather than leave nothing
        stuck = lprobs.max(dim=-1).values.eq(-math.inf)
        lprobs[:, :, self.eos] = torch.where(stuck, eos, lprobs[:, :, self.eos])
        return self.inner.step(step, lprobs, scores, prev_output_tokens, original_batch_idxs)

    def set_src_lengths(self, src_lengths):
        self.inner.set_src_lengths(src_lengths)

    def init_constraints(self, batch_constraints: Optional[Tensor], beam_size: int):
        self.inner.init_constraints(batch_constraints, beam_size)

    def prune_sentences(self, batch_idxs: Tensor):
        self.inner.prune_sentences(batch_idxs)

    def update_constraints(self, active_hypos: Tensor):
        self.inner.update_constraints(active_hypos)
