"""Which preceding sentences form the context of each sentence of a corpus with documents.

The BPT paper (section 4.3.1) takes "its preceding context of fixed length" for every sentence;
its context lengths (0, 32, 64, 128 in Table 6) are token counts: the original implementation
counts source tokens (end-of-sentence marks included) and caps whole samples at 512 tokens,
which 128 *sentences* of TED talks (average document: 120 sentences) would overflow many times.
Here the context of sentence i is the longest run of whole sentences directly before i, in the
same document, whose source lengths (each counted with its separator) add up to at most l.
"""

from pathlib import Path
from typing import List, Sequence

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


def context_starts(docids: Sequence[str], source_lengths, max_context_tokens: int) -> np.ndarray:
    """First sentence of each sentence's context window (equal to i when it has no context).

    ``source_lengths[j]`` counts sentence j's tokens plus one end mark (the separator it gets
    in a sample). The window of sentence i is [start, i): whole sentences, never before the
    first sentence of i's document, total length at most ``max_context_tokens``.
    """
    if max_context_tokens < 0:
        raise ValueError(f"context length must be >= 0, got {max_context_tokens}")
    lengths = np.asarray(source_lengths, dtype=np.int64)
    if len(lengths) != len(docids):
        raise ValueError(
            f"{len(docids)} document ids for {len(lengths)} sentences: the docids file must "
            "have one line per sentence of the split"
        )
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
