"""Subword-nmt BPE: merges learnt from word counts, and applied line by line in worker processes
(the merges are loaded once per process)."""

import functools
from collections import Counter
from pathlib import Path
from typing import List

from tqdm import tqdm

from .progress import Progress, log

_BPE = None  # per-process subword-nmt BPE


def init_bpe(codes: str) -> None:
    """Load subword-nmt merges into this process (a ``map_lines`` initializer: once per worker)."""
    global _BPE
    from subword_nmt.apply_bpe import BPE

    with open(codes, encoding="utf-8") as fh:
        _BPE = BPE(fh)


def apply_bpe(line: str) -> str:
    """``line`` split by the merges ``init_bpe`` loaded."""
    return _BPE.process_line(line)


def learn_bpe(texts: List[List[str]], merges: int, codes: Path) -> None:
    """subword-nmt merges learnt from the word counts of ``texts`` (counting and merging both show
    progress with an ETA on a terminal: subword-nmt's own bar for the merges)."""
    import subword_nmt.learn_bpe as subword_learn

    counts: Counter = Counter()
    with Progress(sum(map(len, texts)), f"word counts for {codes.name}") as bar:
        for lines in texts:
            for line in lines:
                counts.update(line.split())
            bar.update(len(lines))
    log(f"learning {merges} BPE merges from {len(counts)} word types -> {codes.name}")
    subword_learn.tqdm = functools.partial(tqdm, disable=None)  # its bar on a terminal only
    with open(codes, "w", encoding="utf-8") as out:
        subword_learn.learn_bpe([f"{word} {n}\n" for word, n in counts.items()], out, merges,
                                min_frequency=2, is_dict=True)
