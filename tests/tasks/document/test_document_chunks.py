"""The original BPT code's document samples (``--document-samples chunks``): chunk boundaries,
the samples built on them, and decoding that gives exactly one translation per source sentence."""

import argparse
import random

import numpy as np
import pytest
import torch

pytest.importorskip("fairseq")
from fairseq.data import Dictionary  # noqa: E402
from fairseq.models import FairseqDecoder, FairseqEncoderDecoderModel  # noqa: E402

from fairseq_plugins.data.document_context import chunk_bounds, sample_windows  # noqa: E402
from fairseq_plugins.data.document_pair_dataset import DocumentPairDataset  # noqa: E402
from fairseq_plugins.tasks.document_translation import (  # noqa: E402
    DocumentTranslationConfig,
    DocumentTranslationTask,
)
from tests.tasks.document.test_document_dataset import Sentences, toy_corpus  # noqa: E402
from tests.tasks.document.test_document_decoding import _Encoder  # noqa: E402


def original_chunks(docids, lengths, context_length):
    """yzh119/BPT@3ce980d graph/mt.py, DocumentMTDataset.__init__, transcribed: per document,
    sentences are added to the last segment until it holds context_length // 2 tokens."""
    bounds, i = [], 0
    while i < len(docids):
        end = i
        while end < len(docids) and docids[end] == docids[i]:
            end += 1
        length, segments = 0, [[]]
        for j in range(i, end):
            length += lengths[j]  # the original adds len(src) + 1: fairseq's sizes count the </s>
            segments[-1].append(j)
            if length >= context_length // 2:
                length = 0
                segments.append([])
        if len(segments[-1]) == 0:
            segments.pop()
        bounds += [(s[0], s[-1] + 1) for s in segments]
        i = end
    return bounds


def random_corpus(seed):
    rng = random.Random(seed)
    docids = [f"d{d}" for d in range(25) for _ in range(rng.randint(1, 14))]
    return docids, [rng.randint(2, 40) for _ in docids]


@pytest.mark.parametrize("limit", [0, 1, 7, 32, 64, 128])
def test_chunks_are_the_originals(limit):
    docids, lengths = random_corpus(limit)
    assert chunk_bounds(docids, lengths, limit) == original_chunks(docids, lengths, limit)


@pytest.mark.parametrize("limit", [0, 32, 64, 128])
def test_chunks_cover_each_sentence_once_with_whole_sentences_of_at_least_half_l(limit):
    docids, lengths = random_corpus(100 + limit)
    chunks = chunk_bounds(docids, lengths, limit)
    assert [s for start, end in chunks for s in range(start, end)] == list(range(len(docids)))
    short_last = 0
    for start, end in chunks:
        assert end > start and len(set(docids[start:end])) == 1  # whole sentences of one document
        tokens = sum(lengths[start:end])
        # closed at the first sentence end that reaches limit/2
        assert end - start == 1 or sum(lengths[start : end - 1]) < limit // 2
        document_ends_here = end == len(docids) or docids[end] != docids[start]
        if tokens < limit // 2:
            assert document_ends_here  # only a document's last chunk may be short
            short_last += 1
    assert limit == 0 or short_last > 0  # the case exists in this corpus


def test_a_sample_is_the_previous_chunk_of_its_document_and_the_current_one():
    docids = ["a"] * 5 + ["b"] * 3
    lengths = [3, 4, 5, 2, 9, 1, 1, 20]
    assert chunk_bounds(docids, lengths, 8) == [(0, 2), (2, 3), (3, 5), (5, 8)]
    windows = sample_windows("chunks", docids, lengths, 8)
    assert windows.context_start.tolist() == [0, 0, 2, 5]  # b's first chunk: no context from a
    assert windows.current_start.tolist() == [0, 2, 3, 5]
    assert windows.current_end.tolist() == [2, 3, 5, 8]
    at_zero = sample_windows("chunks", docids, lengths, 0)  # the original's context_len 0: sentences alone
    assert at_zero.context_start.tolist() == at_zero.current_start.tolist() == list(range(8))
    with pytest.raises(ValueError, match="layout"):
        sample_windows("paragraphs", docids, lengths, 8)


def test_chunk_samples_train_on_every_target_sentence_of_the_sample():
    """The original's MTBatcher labels the whole target, the previous chunk's sentences included."""
    d, src, tgt, docids = toy_corpus()  # sizes (with </s>) 3, 2, 4 | 2, 3, 2
    sep, eos, pad = d.bos(), d.eos(), d.pad()
    ds = DocumentPairDataset(src, tgt, d, d, docids, max_context_tokens=8, samples="chunks")  # chunks of >= 4
    assert [list(ds.sentences(i)) for i in range(len(ds))] == [[0, 1], [2], [3, 4], [5]]
    assert ds[1]["source"].tolist() == [4, 5, sep, 6, sep, 7, 8, 9, eos]
    assert ds[2]["target"].tolist() == [11, sep, 12, 13, eos] and len(ds[2]["target_context"]) == 0
    batch = ds.collater([ds[1], ds[3]])
    assert batch["target"].tolist() == [
        [5, 6, sep, 7, sep, 8, 9, 10, eos],
        [11, sep, 12, 13, sep, 14, eos, pad, pad],
    ]
    assert batch["net_input"]["prev_output_tokens"][0].tolist() == [eos, 5, 6, sep, 7, sep, 8, 9, 10]
    assert batch["ntokens"] == 9 + 7
    assert ds.src_sizes.tolist() == [5, 9, 5, 7] and ds.position_in_document.tolist() == [0, 1, 0, 1]


# decoding -----------------------------------------------------------------------------------

N_WORDS = 6


class _EagerDecoder(FairseqDecoder):
    """Logits from the previous token (a fixed random table): after a word </s> first, then <s>;
    at the start of a sentence a word. Left alone, it ends a chunk after its first sentence."""

    def __init__(self, dictionary, separator):
        super().__init__(dictionary)
        self.table = torch.randn(len(dictionary), len(dictionary), generator=torch.Generator().manual_seed(5))
        self.table[:, dictionary.eos()] += 3.0
        self.table[:, separator] += 2.0
        for start in (dictionary.eos(), separator):
            self.table[start, [dictionary.eos(), separator]] = -10.0

    def forward(self, prev_output_tokens, encoder_out=None, **kwargs):
        return self.table[prev_output_tokens], None

    def max_positions(self):
        return 1024


def _task_and_model(target_context="same-pass"):
    d = Dictionary()
    for i in range(N_WORDS):
        d.add_symbol(f"w{i}")
    cfg = DocumentTranslationConfig(context_tokens=10, document_samples="chunks", target_context=target_context)
    task = DocumentTranslationTask(cfg, d, d)
    model = FairseqEncoderDecoderModel(_Encoder(d), _EagerDecoder(d, task.sentence_separator)).eval()
    return task, model


def _corpus(task, n=14):
    """Two documents of sentences of 2-4 words: chunks of 1-3 sentences at l = 10."""
    d, rng = task.source_dictionary, np.random.default_rng(0)
    words = [list(rng.integers(d.nspecial, len(d), size=rng.integers(2, 5))) for _ in range(n)]
    src = Sentences([w + [d.eos()] for w in words])
    tgt = Sentences([list(reversed(w)) + [d.eos()] for w in words])
    docids = ["a"] * 9 + ["b"] * (n - 9)
    dataset = DocumentPairDataset(src, tgt, d, d, docids, 10, shuffle=False, split="test", samples="chunks",
                                  document_order=task.cfg.target_context == "translations")
    task.datasets["test"], task.translations["test"] = dataset, {}
    return dataset


def _decode_split(task, model, beam=3, nbest=3):
    generator = task.build_generator([model], argparse.Namespace(beam=beam, nbest=nbest, max_len_a=0, max_len_b=40))
    dataset = task.dataset("test")
    rows = []
    batches = task.get_batch_iterator(dataset, max_sentences=2).next_epoch_itr(shuffle=False)
    for sample in batches:
        samples = sample["id"].tolist()
        hypos = task.inference_step(generator, [model], sample)
        rows.append((samples, sample, hypos))
    return rows


@pytest.mark.parametrize("mode", ["same-pass", "oracle-reference", "translations"])
def test_each_sentence_is_output_once_against_its_own_reference(mode):
    task, model = _task_and_model(mode)
    dataset = _corpus(task)
    assert max(len(dataset.sentences(i)) for i in range(len(dataset))) >= 2
    seen = []
    for samples, sample, hypos in _decode_split(task, model):
        ids = sample["id"].tolist()
        assert ids == [s for i in samples for s in dataset.sentences(i)]  # one row per current sentence
        assert len(hypos) == len(ids)
        pad, eos = task.target_dictionary.pad(), task.target_dictionary.eos()
        for row, sentence in enumerate(ids):
            reference = sample["target"][row][sample["target"][row].ne(pad)]
            assert reference.tolist() == dataset.tgt[sentence].tolist()
            source = sample["net_input"]["src_tokens"][row]
            assert source[source.ne(pad)].tolist() == dataset.src[sentence].tolist()
            for hypo in hypos[row]:
                tokens = hypo["tokens"]
                assert tokens[-1] == eos and not tokens[:-1].eq(eos).any()
                assert not tokens.eq(task.sentence_separator).any()
                assert len(hypo["positional_scores"]) == len(tokens)
                assert float(hypo["score"]) == pytest.approx(float(hypo["positional_scores"].sum()) / len(tokens))
        assert sample["nsentences"] == len(ids)
        seen += ids
    assert sorted(seen) == list(range(len(dataset.src)))  # none lost, none twice


def test_the_search_holds_a_chunk_at_its_number_of_sentences():
    task, model = _task_and_model()
    dataset = _corpus(task)
    sample = dataset.collater([dataset[i] for i in range(len(dataset))])
    wanted = sample["net_input"]["src_tokens"].eq(task.sentence_separator).sum(dim=1)
    args = argparse.Namespace(beam=3, nbest=3, max_len_a=0, max_len_b=40)
    held = task.build_generator([model], args)
    held.search.expect(sample["id"], wanted)
    free = DocumentTranslationTask(
        DocumentTranslationConfig(context_tokens=10), task.source_dictionary, task.target_dictionary
    ).build_generator([model], args)
    with torch.no_grad():
        for generator, exact in ((held, True), (free, False)):
            hypos = generator.generate([model], sample)
            counts = [[int(h["tokens"].eq(task.sentence_separator).sum()) for h in row] for row in hypos]
            assert all(c == int(n) for row, n in zip(counts, wanted) for c in row) == exact


def test_a_translation_cut_by_the_maximum_length_keeps_one_row_per_sentence(caplog):
    task, model = _task_and_model()
    dataset = _corpus(task)
    generator = task.build_generator([model], argparse.Namespace(beam=2, nbest=1, max_len_a=0, max_len_b=1))
    index = next(i for i in range(len(dataset))  # a chunk of several sentences without context
                 if len(dataset.sentences(i)) > 1 and dataset.context_start[i] == dataset.current_start[i])
    sample = dataset.collater([dataset[index]])
    hypos = task.inference_step(generator, [model], sample)
    assert sample["id"].tolist() == list(dataset.sentences(index)) and len(hypos) == len(dataset.sentences(index))
    assert hypos[-1][0]["tokens"].tolist() == [task.target_dictionary.eos()]
    assert "raise --max-len-b" in caplog.text


def test_alignment_printing_is_refused_with_chunks():
    task, model = _task_and_model()
    with pytest.raises(ValueError, match="print-alignment"):
        task.build_generator([model], argparse.Namespace(beam=2, print_alignment="hard"))


def test_the_target_context_is_the_models_own_translation_of_the_previous_chunk():
    task, model = _task_and_model("translations")
    dataset = _corpus(task)
    generator = task.build_generator([model], argparse.Namespace(beam=3, max_len_a=0, max_len_b=40))
    prefixes, generate = {}, generator.generate

    def recording(models, sample, prefix_tokens=None, **kwargs):
        for row, index in enumerate(sample["id"].tolist()):
            prefix = prefix_tokens[row] if prefix_tokens is not None else torch.zeros(0, dtype=torch.long)
            prefixes[index] = prefix[prefix.ne(generator.pad)].tolist()
        return generate(models, sample, prefix_tokens=prefix_tokens, **kwargs)

    generator.generate = recording
    outputs = {}
    for sample in task.get_batch_iterator(dataset, max_sentences=3).next_epoch_itr(shuffle=False):
        hypos = task.inference_step(generator, [model], sample)  # sample: now one row per sentence
        for sentence, row in zip(sample["id"].tolist(), hypos):
            outputs[sentence] = row[0]["tokens"][:-1].tolist()
    sep, with_context = task.sentence_separator, 0
    for index in range(len(dataset)):
        previous = range(int(dataset.context_start[index]), int(dataset.current_start[index]))
        assert prefixes[index] == [t for s in previous for t in outputs[s] + [sep]]
        with_context += len(previous) > 0
    assert with_context >= 3
