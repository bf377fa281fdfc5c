"""Context windows and sample layout of document-level translation (torch/numpy only)."""

import random

import pytest
import torch

from fairseq_plugins.data.document_context import context_starts, document_starts, read_docids
from fairseq_plugins.data.document_layout import (
    aligned_sentence_mask,
    source_sentence_index,
    target_sentence_index,
)
from tests.cli import FIXTURES

FIXTURE = FIXTURES / "doc"


def brute_force_starts(docids, lengths, limit):
    """Longest run of whole preceding same-document sentences with at most `limit` tokens."""
    starts = []
    for i in range(len(docids)):
        start = i
        while start > 0 and docids[start - 1] == docids[i] and sum(lengths[start - 1 : i]) <= limit:
            start -= 1
        starts.append(start)
    return starts


@pytest.mark.parametrize("limit", [0, 1, 7, 32, 64, 128])
def test_context_windows_match_brute_force(limit):
    rng = random.Random(limit)
    docids = [f"d{d}" for d in range(30) for _ in range(rng.randint(1, 12))]
    lengths = [rng.randint(1, 40) for _ in docids]
    assert context_starts(docids, lengths, limit).tolist() == brute_force_starts(docids, lengths, limit)


def test_zero_context_is_sentence_level():
    docids = ["a"] * 5 + ["b"] * 3
    assert context_starts(docids, [3] * 8, 0).tolist() == list(range(8))


def test_context_stays_inside_documents_of_the_fixture():
    docids = read_docids(FIXTURE / "train.docids")
    lengths = [len(line.split()) + 1 for line in (FIXTURE / "train.en").read_text().splitlines()]
    starts = context_starts(docids, lengths, 10_000)
    doc_start = document_starts(docids)
    # with an unbounded budget every sentence sees exactly its document's earlier sentences
    assert starts.tolist() == doc_start.tolist()
    assert len(set(docids)) == 40 and starts.tolist() != list(range(len(docids)))


def test_bad_docids_are_rejected(tmp_path):
    path = tmp_path / "x.docids"
    path.write_text("t1\nt1\nt2\nt1\n")
    with pytest.raises(ValueError, match="reappears"):
        read_docids(path)
    path.write_text("t1\n\nt2\n")
    with pytest.raises(ValueError, match="empty document id"):
        read_docids(path)
    with pytest.raises(FileNotFoundError, match="docids"):
        read_docids(tmp_path / "missing.docids")
    with pytest.raises(ValueError, match="one line per sentence"):
        context_starts(["a", "a"], [3, 4, 5], 8)
    with pytest.raises(ValueError, match=">= 0"):
        context_starts(["a"], [3], -1)


SEP, PAD, EOS = 0, 1, 2


def test_sentence_index_of_source_and_decoder_positions():
    # source: left padding, then  s1 s1 <s> s2 <s> s3 </s>
    src = torch.tensor([[PAD, 7, 8, SEP, 9, SEP, 10, EOS]])
    assert source_sentence_index(src, SEP).tolist() == [[0, 0, 0, 0, 1, 1, 2, 2]]
    # decoder input: </s> t1 t1 <s> t2 <s> t3  (the <s> input predicts the next sentence)
    prev = torch.tensor([[EOS, 7, 8, SEP, 9, SEP, 10, PAD]])
    assert target_sentence_index(prev, SEP).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]


def test_aligned_sentence_mask():
    src = torch.tensor([[7, SEP, 8, 9, EOS], [PAD, PAD, PAD, 8, EOS]])
    prev = torch.tensor([[EOS, 5, SEP, 6, 6], [EOS, 6, SEP, 5, PAD]])
    blocked = aligned_sentence_mask(src, prev, SEP, PAD)
    visible = (~blocked).long()
    assert visible[0].tolist() == [
        [1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1],
        [0, 0, 1, 1, 1],
        [0, 0, 1, 1, 1],
    ]
    # second row: one source sentence; a decoder that emits <s> anyway stays on it, padding stays hidden
    assert visible[1].tolist() == [[0, 0, 0, 1, 1]] * 5
    assert not blocked.all(dim=-1).any()
