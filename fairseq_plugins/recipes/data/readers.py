"""Readers of the raw formats the corpora come in: plain text, mteval XML (WMT ``.sgm``, IWSLT
``.xml``) and IWSLT's TED ``train.tags`` files, with the document id of every sentence where the
format has one."""

import gzip
import re
import zlib
from pathlib import Path
from typing import List, Sequence, Tuple

# what a truncated or damaged .gz, .tar(.gz) or .zip raises while it is read
DAMAGED_ARCHIVE = (EOFError, zlib.error, gzip.BadGzipFile)


class BadRawData(ValueError):
    """Raw files that cannot make a data-bin (damaged, misaligned, empty): the message names the
    file or split and is all the user sees."""


def damaged(path: Path, err: Exception) -> BadRawData:
    return BadRawData(f"{path} is truncated or damaged ({type(err).__name__}: {err}); delete it and download "
                      "or copy it again")


def _open_text(path: Path):
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_plain(path: Path) -> List[str]:
    """One sentence per line (Europarl, CommonCrawl, News Commentary, Multi30K, ...)."""
    try:
        with _open_text(path) as fh:
            return [line.rstrip("\n").strip() for line in fh]
    except DAMAGED_ARCHIVE as err:
        raise damaged(path, err) from err


def read_parallel(src: Path, tgt: Path, what: str) -> Tuple[List[str], List[str]]:
    """The two sides of ``what`` (a split, a corpus), which must have a line each per pair."""
    s, t = read_plain(src), read_plain(tgt)
    if len(s) != len(t):
        raise BadRawData(f"{what}: {src} has {len(s):,} lines but {tgt} has {len(t):,}; the two sides must be "
                         "aligned line by line")
    return s, t


_DOC_RE = re.compile(r'<doc\s[^>]*docid="([^"]*)"', re.IGNORECASE)
_SEG_RE = re.compile(r"<seg[^>]*>(.*)</seg>", re.IGNORECASE)


def read_mteval(path: Path) -> List[tuple]:
    """(docid, sentence) pairs from an mteval XML file: WMT ``*.sgm`` and IWSLT ``*.xml``.

    Like sacrebleu, the text inside ``<seg>`` is taken as-is (whitespace collapsed).
    """
    pairs, docid = [], None
    with _open_text(path) as fh:
        for line in fh:
            doc = _DOC_RE.search(line)
            if doc:
                docid = doc.group(1)
            seg = _SEG_RE.search(line)
            if seg:
                if docid is None:
                    raise ValueError(f"{path}: <seg> outside a <doc docid=...>")
                pairs.append((docid, " ".join(seg.group(1).split())))
    if not pairs:
        raise ValueError(f"{path}: no <seg> elements found; is it an mteval .sgm/.xml file?")
    return pairs


_TAG_LINE_RE = re.compile(r"^\s*<(\w+)[^>]*>(.*?)(</\1>)?\s*$")


def read_ted_tags(path: Path, keep_tags: Sequence[str] = ()) -> List[tuple]:
    """(talk id, sentence) pairs from an IWSLT ``train.tags.{src}-{tgt}.{lang}`` file.

    Metadata lines (``<url>``, ``<talkid>``, ``<keywords>``, ...) are dropped, except
    the text of tags in ``keep_tags`` (fairseq's IWSLT14 recipe keeps title and
    description). A talk starts at ``<url>``; its id is the following ``<talkid>``.
    """
    pairs: List[tuple] = []
    talk = None
    pending: List[int] = []  # indices of sentences seen before this talk's <talkid>
    with _open_text(path) as fh:
        for line in fh:
            line = line.strip()
            tag = _TAG_LINE_RE.match(line) if line.startswith("<") else None
            if tag is None:
                if talk is None and not pending and not pairs:
                    raise ValueError(f"{path}: text before the first <url>/<talkid>")
                pairs.append((talk, line))
                if talk is None:
                    pending.append(len(pairs) - 1)
                continue
            name, text = tag.group(1).lower(), tag.group(2).strip()
            if name == "url":
                talk, pending = None, []
            elif name == "talkid":
                talk = text
                for i in pending:
                    pairs[i] = (talk, pairs[i][1])
                pending = []
            elif name in keep_tags:
                pairs.append((talk, text))
                if talk is None:
                    pending.append(len(pairs) - 1)
    if any(t is None for t, _ in pairs):
        raise ValueError(f"{path}: a talk has no <talkid>")
    return pairs


def parallel_docs(src: List[tuple], tgt: List[tuple], what: str):
    """Check two (docid, text) lists are sentence-aligned; return (docids, src, tgt)."""
    if len(src) != len(tgt):
        raise ValueError(f"{what}: {len(src)} source vs {len(tgt)} target sentences")
    for i, ((ds, _), (dt, _)) in enumerate(zip(src, tgt)):
        if ds != dt:
            raise ValueError(f"{what}: sentence {i} is in document {ds!r} vs {dt!r}")
    return [d for d, _ in src], [s for _, s in src], [t for _, t in tgt]
