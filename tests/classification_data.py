"""Tiny sentence-classification and tagging corpora for the end-to-end tests, in fairseq's layout.

Sentences are Multi30K English captions (the committed fixture). The labels are rules a tiny
model learns in a few dozen updates: a sentence is ``person`` when it mentions a man or woman
(else ``other``); a pair is ``same`` when both sentences share their first noun-ish word;
a word's tag is ``B-PER``/``I-PER`` on ``man``/``woman`` phrases ("a young man") and ``O`` else.
"""

from pathlib import Path
from typing import List

from tests.cli import _read_multi30k, run_cli

PERSON = {"man", "men", "woman", "women", "boy", "girl", "boys", "girls"}


def sentences(split: str, n: int) -> List[str]:
    lines = [s for s in _read_multi30k(split, "en", n, 30) if 0 < len(s.split()) <= 20]
    return lines[:n]


def sentence_label(sentence: str) -> str:
    return "person" if PERSON & set(sentence.split()) else "other"


def tags(sentence: str) -> List[str]:
    words = sentence.split()
    out = ["O"] * len(words)
    for i, w in enumerate(words):
        if w in PERSON:
            start = i - 1 if i > 0 and words[i - 1] in {"young", "old", "little"} else i
            out[start] = "B-PER"
            for j in range(start + 1, i + 1):
                out[j] = "I-PER"
    return out


def _preprocess(folder: Path, prefixes, dest: Path, srcdict=None):
    args = ["--only-source", "--trainpref", prefixes["train"], "--validpref", prefixes["valid"],
            "--testpref", prefixes["test"], "--destdir", dest, "--workers", "1"]
    if srcdict is not None:
        args += ["--srcdict", srcdict]
    run_cli("fairseq-preprocess", *args)


def write_classification(tmp: Path, pairs: bool = False, n_train: int = 160, n_eval: int = 40) -> Path:
    """fairseq-preprocess output in ``input0/`` (``input1/``) and ``label/``: tmp/data-bin."""
    raw = tmp / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    splits = {"train": sentences("train", n_train + 1), "valid": sentences("val", n_eval + 1),
              "test": sentences("test_2016_flickr", n_eval + 1)}
    prefixes = {}
    for split, lines in splits.items():
        first, second = lines[:-1], lines[1:]
        (raw / f"{split}.input0").write_text("".join(s + "\n" for s in first))
        if pairs:
            (raw / f"{split}.input1").write_text("".join(s + "\n" for s in second))
            labels = ["same" if sentence_label(a) == sentence_label(b) else "different" for a, b in zip(first, second)]
        else:
            labels = [sentence_label(s) for s in first]
        (raw / f"{split}.label").write_text("".join(lab + "\n" for lab in labels))
        prefixes[split] = raw / split
    out = tmp / "data-bin"
    _preprocess(raw, {k: f"{v}.input0" for k, v in prefixes.items()}, out / "input0")
    if pairs:
        _preprocess(raw, {k: f"{v}.input1" for k, v in prefixes.items()}, out / "input1",
                    srcdict=out / "input0" / "dict.txt")
    _preprocess(raw, {k: f"{v}.label" for k, v in prefixes.items()}, out / "label")
    return out


def write_tagging(tmp: Path, n_train: int = 160, n_eval: int = 40) -> Path:
    """Word and tag files binarized as the sequence_tagging task reads them: tmp/data-bin."""
    raw = tmp / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    prefixes = {}
    sources = (("train", "train", n_train), ("valid", "val", n_eval), ("test", "test_2016_flickr", n_eval))
    for split, source, n in sources:
        lines = sentences(source, n)
        (raw / f"{split}.input0").write_text("".join(s + "\n" for s in lines))
        (raw / f"{split}.label").write_text("".join(" ".join(tags(s)) + "\n" for s in lines))
        prefixes[split] = raw / split
    out = tmp / "data-bin"
    _preprocess(raw, {k: f"{v}.input0" for k, v in prefixes.items()}, out / "input0")
    _preprocess(raw, {k: f"{v}.label" for k, v in prefixes.items()}, out / "label")
    return out
