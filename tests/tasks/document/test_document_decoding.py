"""Document decoding scores the current sentence as sentence-level decoding does.

The target context is forced as a decoder prefix; fairseq would divide a hypothesis's log
probability by (prefix + sentence length) ** lenpen. The model here predicts from the position
inside the current sentence and the previous token only, so it ignores the context: with a
correct normalisation, decoding a sentence behind a long forced context must give exactly the
hypotheses, scores and ranking of decoding it alone, for every length penalty.
"""

import argparse

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.models import FairseqDecoder, FairseqEncoder, FairseqEncoderDecoderModel

from fairseq_plugins.tasks.document_translation import DocumentTranslationConfig, DocumentTranslationTask

N_WORDS, MAX_POSITION = 6, 12


class _Encoder(FairseqEncoder):
    def forward(self, src_tokens, src_lengths=None, **kwargs):
        return {"encoder_out": [src_tokens.float().unsqueeze(-1)]}

    def reorder_encoder_out(self, encoder_out, new_order):
        return {"encoder_out": [encoder_out["encoder_out"][0].index_select(0, new_order)]}


class _ContextBlindDecoder(FairseqDecoder):
    """Logits from (position in the current sentence, previous token): a fixed random table."""

    def __init__(self, dictionary, separator):
        super().__init__(dictionary)
        generator = torch.Generator().manual_seed(3)
        self.table = 2.0 * torch.randn(MAX_POSITION, len(dictionary), len(dictionary), generator=generator)
        self.table[:, :, separator] -= 6.0  # the model rarely starts a sentence of its own
        self.table[:, :, dictionary.eos()] += torch.linspace(-2.0, 3.0, MAX_POSITION).unsqueeze(-1)
        self.separator = separator

    def forward(self, prev_output_tokens, encoder_out=None, **kwargs):
        # position inside the current sentence: tokens since the last separator (or the start)
        position = torch.ones_like(prev_output_tokens).cumsum(-1) - 1
        starts = torch.where(prev_output_tokens.eq(self.separator), position, torch.zeros_like(position))
        inside = (position - torch.cummax(starts, dim=-1).values).clamp(max=MAX_POSITION - 1)
        # a sentence starts after </s> alone or after <s>: the same state
        previous = prev_output_tokens.masked_fill(prev_output_tokens.eq(self.separator), self.dictionary.eos())
        return self.table[inside, previous], None

    def max_positions(self):
        return 1024


def _dictionary():
    dictionary = Dictionary()
    for i in range(N_WORDS):
        dictionary.add_symbol(f"w{i}")
    return dictionary


def _setup():
    dictionary = _dictionary()
    task = DocumentTranslationTask(
        DocumentTranslationConfig(context_tokens=64, target_context="oracle-reference"), dictionary, dictionary
    )
    decoder = _ContextBlindDecoder(dictionary, task.sentence_separator)
    model = FairseqEncoderDecoderModel(_Encoder(dictionary), decoder).eval()
    return task, model


def _sample(task, context_sentences):
    """One test sentence behind ``context_sentences`` context sentences (of 9 target tokens each)."""
    d, sep = task.source_dictionary, task.sentence_separator
    words = [d.index(f"w{i % N_WORDS}") for i in range(9)]
    src = sum(([*words[:4], sep] for _ in range(context_sentences)), []) + words[:5] + [d.eos()]
    sample = {
        "id": torch.tensor([0]),
        "net_input": {"src_tokens": torch.tensor([src]), "src_lengths": torch.tensor([len(src)])},
    }
    if context_sentences:
        context = sum(([*words, sep] for _ in range(context_sentences)), [])
        sample.update(document_split="test", target_context=torch.tensor([context]))
    return sample


def _decode(task, model, sample, lenpen):
    generator = task.build_generator(
        [model], argparse.Namespace(beam=4, nbest=4, lenpen=lenpen, max_len_a=0, max_len_b=MAX_POSITION)
    )
    (hypos,) = task.inference_step(generator, [model], sample)
    return [(hypo["tokens"].tolist(), float(hypo["score"])) for hypo in hypos]


@pytest.mark.parametrize("lenpen", [0.3, 1.0, 3.0])
def test_a_forced_context_leaves_hypotheses_and_scores_as_sentence_level(lenpen):
    task, model = _setup()
    alone = _decode(task, model, _sample(task, 0), lenpen)
    behind_context = _decode(task, model, _sample(task, 8), lenpen)  # a prefix of 80 tokens
    assert [tokens for tokens, _ in behind_context] == [tokens for tokens, _ in alone]
    assert [score for _, score in behind_context] == pytest.approx([score for _, score in alone], abs=1e-4)


def test_the_length_penalty_changes_the_best_document_hypothesis():
    """Guards the test above: on this model the length penalty matters (short wins at 0.3,
    long at 3.0), so a normalisation over the prefix would show."""
    task, model = _setup()
    short = _decode(task, model, _sample(task, 8), 0.3)[0][0]
    long = _decode(task, model, _sample(task, 8), 3.0)[0][0]
    assert len(short) < len(long)


def test_scores_are_the_current_sentence_log_probability_over_its_length():
    task, model = _setup()
    generator = task.build_generator([model], argparse.Namespace(beam=4, nbest=4, lenpen=2.0, max_len_b=12))
    (hypos,) = task.inference_step(generator, [model], _sample(task, 8))
    for hypo in hypos:
        assert float(hypo["score"]) == pytest.approx(
            float(hypo["positional_scores"].sum()) / len(hypo["tokens"]) ** 2.0, abs=1e-5
        )
    assert [float(h["score"]) for h in hypos] == sorted((float(h["score"]) for h in hypos), reverse=True)
