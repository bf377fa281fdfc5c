"""Which preceding sentences form the context of each sentence of a corpus with documents.

The BPT paper (section 4.3.1) takes "its preceding context of fixed length" for every sentence;
its context lengths (0, 32, 64, 128 in Table 6) are token counts: the original implementation
counts source tokens (end-of-sentence marks included) and caps whole samples at 512 tokens,
which 128 *sentences* of TED talks (average document: 120 sentences) would overflow many times.
Here the context of sentence i is the longest run of whole sentences directly before i, in the
same document, whose source lengths (each counted with its separator) add up to at most l.

The original code (yzh119/BPT ``graph/mt.py`` ``DocumentMTDataset``) builds its samples another
way, kept here as the ``chunks`` layout: each document is cut into chunks of whole sentences of at
least l/2 source tokens, and a sample is the previous chunk and the current one (``sample_windows``).
"""

from dataclasses import dataclass

from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np


def read_docids(path) -> List[str]:
    """One document id per line of ``path``; blank lines and non-contiguous documents are errors."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"document ids not found: {path} (one document id per sentence, next to the "
            "binarized data; see docs/document_level.md)"
        )
    docids = path.read_text(encoding="utf-8").splitlines()
    for line_no, doc in enumerate(docids, start=1):
        if not doc.strip():
            raise ValueError(f"{path}:{line_no}: empty document id")
    check_contiguous(docids, str(path))
    return [doc.strip() for doc in docids]


def check_contiguous(docids: Sequence[str], where: str = "docids") -> None:
    """A document's sentences must be consecutive, or 'preceding sentences' means nothing."""
    seen = set()
    previous = None
    for line_no, doc in enumerate(docids, start=1):
        if doc != previous:
            if doc in seen:
                raise ValueError(
                    f"{where}:{line_no}: document {doc!r} reappears after other documents; "
                    "the sentences of a document must be consecutive and in order"
                )
            seen.add(doc)
            previous = doc


def document_starts(docids: Sequence[str]) -> np.ndarray:
    """For each sentence, the index of the first sentence of its document."""
    starts = np.zeros(len(docids), dtype=np.int64)
    for i in range(1, len(docids)):
        starts[i] = starts[i - 1] if docids[i] == docids[i - 1] else i
    return starts


def _checked_lengths(docids: Sequence[str], source_lengths, context_tokens: int) -> np.ndarray:
    """The sentence lengths as an array, once the context length and the ids agree with them."""
    if context_tokens < 0:
        raise ValueError(f"context length must be >= 0, got {context_tokens}")
    lengths = np.asarray(source_lengths, dtype=np.int64)
    if len(lengths) != len(docids):
        raise ValueError(
            f"{len(docids)} document ids for {len(lengths)} sentences: the docids file must "
            "have one line per sentence of the split"
        )
    return lengths


def context_starts(docids: Sequence[str], source_lengths, max_context_tokens: int) -> np.ndarray:
    """First sentence of each sentence's context window (equal to i when it has no context).

    ``source_lengths[j]`` counts sentence j's tokens plus one end mark (the separator it gets
    in a sample). The window of sentence i is [start, i): whole sentences, never before the
    first sentence of i's document, total length at most ``max_context_tokens``.
    """
    lengths = _checked_lengths(docids, source_lengths, max_context_tokens)
    doc_start = document_starts(docids)
    starts = np.arange(len(lengths), dtype=np.int64)
    window_start, window_tokens = 0, 0
    for i in range(len(lengths)):
        if doc_start[i] == i:
            window_start, window_tokens = i, 0
        elif i > 0:
            window_tokens += lengths[i - 1]
        while window_tokens > max_context_tokens:
            window_tokens -= lengths[window_start]
            window_start += 1
        starts[i] = window_start
    return starts


def chunk_bounds(docids: Sequence[str], source_lengths, context_tokens: int) -> List[Tuple[int, int]]:
    """[start, end) sentence ranges of the original's chunks, in corpus order.

    A chunk takes the sentences of one document in order and closes as soon as their source
    lengths (each with its end mark) reach ``context_tokens // 2``; a document's last chunk keeps
    what is left, however short (yzh119/BPT ``graph/mt.py``, ``DocumentMTDataset.__init__``).
    """
    lengths = _checked_lengths(docids, source_lengths, context_tokens)
    doc_start = document_starts(docids)
    chunks, start, tokens = [], 0, 0
    for i in range(len(lengths)):
        if doc_start[i] == i and i > start:  # a new document closes the last chunk of the previous one
            chunks.append((start, i))
            start, tokens = i, 0
        tokens += int(lengths[i])
        if tokens >= context_tokens // 2:
            chunks.append((start, i + 1))
            start, tokens = i + 1, 0
    if start < len(lengths):
        chunks.append((start, len(lengths)))
    return chunks


@dataclass
class SampleWindows:
    """Sentence ranges of each sample: context [context_start, current_start), then the current
    sentences [current_start, current_end); all ranges lie in one document."""

    context_start: np.ndarray
    current_start: np.ndarray
    current_end: np.ndarray


SAMPLE_LAYOUTS = ("sentences", "chunks")


def sample_windows(layout: str, docids: Sequence[str], source_lengths, context_tokens: int) -> SampleWindows:
    """The samples of a split: ``sentences`` = one per sentence, with the longest run of whole
    preceding sentences of at most ``context_tokens`` source tokens as context (``context_starts``);
    ``chunks`` = one per chunk (``chunk_bounds``), with the document's previous chunk as context
    (none at ``context_tokens`` 0), as the original BPT code builds them."""
    if layout == "sentences":
        current = np.arange(len(docids), dtype=np.int64)
        return SampleWindows(context_starts(docids, source_lengths, context_tokens), current, current + 1)
    if layout != "chunks":
        raise ValueError(f"unknown document sample layout {layout!r}: one of {', '.join(SAMPLE_LAYOUTS)}")
    bounds = np.asarray(chunk_bounds(docids, source_lengths, context_tokens), dtype=np.int64).reshape(-1, 2)
    current_start, current_end = bounds[:, 0], bounds[:, 1]
    context_start = current_start.copy()
    if context_tokens > 0:
        doc_start = document_starts(docids)
        previous_in_document = np.flatnonzero(doc_start[current_start[1:]] < current_start[1:]) + 1
        context_start[previous_in_document] = current_start[previous_in_document - 1]
    return SampleWindows(context_start, current_start, current_end)
