"""Binarization with the ``fairseq-preprocess`` console script, as a user would run it."""

import shutil
import subprocess
from pathlib import Path
from typing import List, Optional, Sequence

from .progress import log

SPLIT_FLAGS = {"train": "--trainpref", "valid": "--validpref", "test": "--testpref"}


def split_args(text_dir: Path, splits: Sequence[str], suffix: str) -> List[str]:
    """fairseq-preprocess's ``--{train,valid,test}pref text_dir/{split}{suffix}``; fairseq would name any other
    split test1, test2, ..., so one is refused rather than binarized under a name nobody asked for."""
    extra = [s for s in splits if s not in SPLIT_FLAGS]
    if extra:
        raise ValueError(f"only train/valid/test splits can be binarized, got {extra}")
    return [arg for split in splits for arg in (SPLIT_FLAGS[split], str(text_dir / f"{split}{suffix}"))]


def run_fairseq_preprocess(args: Sequence[str]) -> None:
    """The ``fairseq-preprocess`` console script with ``args``; the command goes to the log first."""
    exe = shutil.which("fairseq-preprocess")
    if exe is None:
        raise RuntimeError("fairseq-preprocess not found on PATH: install fairseq with fairseq-plugins-install-fairseq")
    cmd = [exe, *args]
    log("running " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def fairseq_preprocess(text_dir: Path, destdir: Path, src: str, tgt: str, splits: List[str],
                       joined: bool, workers: int = 1, vocab_size: Optional[int] = None) -> None:
    """Binarize ``text_dir/{split}.{lang}`` with the fairseq-preprocess console script; with
    ``vocab_size`` each dictionary keeps at most that many symbols (fairseq's 4 specials included,
    the most frequent types; the rest become <unk>)."""
    args = ["--source-lang", src, "--target-lang", tgt, "--destdir", str(destdir), "--workers", str(max(1, workers)),
            *split_args(text_dir, splits, "")]
    if joined:
        args.append("--joined-dictionary")
    if vocab_size is not None:
        args += ["--nwordssrc", str(vocab_size), "--nwordstgt", str(vocab_size)]
    run_fairseq_preprocess(args)


def fairseq_preprocess_only_source(text_dir: Path, destdir: Path, splits: Sequence[str], workers: int = 1,
                                   suffix: str = ".txt", srcdict: Optional[Path] = None) -> None:
    """Binarize monolingual ``text_dir/{split}{suffix}`` (``--only-source``: ``dict.txt`` and
    ``{split}.bin/.idx``; every symbol is kept): language modeling's text, a classifier's inputs and
    labels. With ``srcdict`` the dictionary is that one, not built from the text."""
    args = ["--only-source", "--destdir", str(destdir), "--workers", str(max(1, workers)),
            *split_args(text_dir, splits, suffix)]
    if srcdict is not None:
        args += ["--srcdict", str(srcdict)]
    run_fairseq_preprocess(args)
