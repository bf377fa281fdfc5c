"""Steps shared by every corpus: find or download the raw files, read the raw formats,
tokenize (sacremoses), learn/apply BPE (subword-nmt), and binarize (fairseq-preprocess).

Layout written under ``out``::

    out/text/{split}.{lang}      tokenized + BPE text, the input of fairseq-preprocess
    out/{split}.raw.{lang}       untokenized text aligned with the binarized split
                                 (the references that sacrebleu scores against)
    out/{split}.docids           one document (TED talk) id per sentence, when known
    out/bpe.codes[.{lang}]       subword-nmt merges
    out/prep.json                what was done (read by fairseq-plugins-evaluate)
    out/dict.*.txt, out/{split}.{src}-{tgt}.{lang}.{bin,idx}   fairseq-preprocess output
"""

import functools
import gzip
import hashlib
import json
import logging
import multiprocessing
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from tqdm import tqdm

DEFAULT_CACHE = Path.home() / ".cache" / "fairseq_plugins" / "raw"


def log(msg: str) -> None:
    print(f"[prepare] {msg}", file=sys.stderr, flush=True)


class Progress:
    """A tqdm bar with rate and ETA on a terminal; in a log file (no TTY) no bar, only one line with
    the count and the time when it ends (bars would fill a log with carriage-return updates)."""

    def __init__(self, total: Optional[int], what: str, unit: str = " lines", **tqdm_kwargs):
        self.what, self.unit, self.n, self.start = what, unit, 0, time.monotonic()
        self.bar = tqdm(total=total, desc=f"[prepare] {what}", unit=unit, mininterval=1.0,
                        file=sys.stderr, disable=None, **tqdm_kwargs)
        self.in_log = bool(self.bar.disable)  # tqdm turned itself off: stderr is no terminal

    def update(self, n: int = 1) -> None:
        self.n += n
        self.bar.update(n)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
        if self.in_log and exc[0] is None:
            log(f"{self.what}: {self.n:,}{self.unit} in {time.monotonic() - self.start:.0f} s")


# --------------------------------------------------------------------------- fetching


@dataclass
class Archive:
    """A public download and the basenames of the files the corpus needs from it."""

    url: str
    members: Sequence[str]
    sha256: Optional[str] = None  # of the archive as downloaded; checked before it is unpacked


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha256(path: Path, expected: Optional[str]) -> None:
    if expected is not None and sha256_of(path) != expected:
        raise ValueError(f"{path}: sha256 {sha256_of(path)} is not the published {expected}: the download is "
                         f"damaged or not the expected file; delete it and run again")


def _download(url: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(dest.suffix + ".part")
    log(f"downloading {url}")
    with urllib.request.urlopen(url) as resp, open(tmp, "wb") as fh, Progress(
        int(resp.headers.get("Content-Length") or 0) or None, dest.name, unit="B", unit_scale=True
    ) as bar:
        while chunk := resp.read(1 << 20):
            fh.write(chunk)
            bar.update(len(chunk))
    tmp.rename(dest)


def _extract(archive: Path, into: Path) -> None:
    """Unpack .tgz/.tar.gz/.tar/.zip, gunzip a single .gz, or copy a plain .txt into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    name = archive.name
    log(f"extracting {name}")
    if name.endswith((".tgz", ".tar.gz", ".tar")):
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
    elif name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(into)
    elif name.endswith(".gz"):
        with gzip.open(archive, "rb") as src, open(into / name[: -len(".gz")], "wb") as dst:
            shutil.copyfileobj(src, dst)
    elif name.endswith(".txt"):  # a plain file downloaded as it is (PTB)
        shutil.copyfile(archive, into / name)
    else:
        raise ValueError(f"don't know how to unpack {archive}")


def _archive_filename(url: str) -> str:
    return url.rstrip("/").split("/")[-1].split("?")[0]


def _find(root: Path, basename: str) -> Optional[Path]:
    """A file called ``basename`` (or ``basename.gz``) anywhere under ``root``."""
    if not root.is_dir():
        return None
    for candidate in (basename, basename + ".gz"):
        hits = sorted(p for p in root.rglob(candidate) if p.is_file())
        if hits:
            return hits[0]
    return None


def locate(
    archives: Sequence[Archive], raw_dir: Optional[Path], cache_dir: Path = DEFAULT_CACHE
) -> Dict[str, Path]:
    """Map every member basename of ``archives`` to a file on disk.

    With ``raw_dir`` the files (or the archives themselves, still packed) must be under
    it: nothing is downloaded. Without it each archive is downloaded into ``cache_dir``
    once and unpacked there. An archive with a published ``sha256`` is checked before it is
    unpacked.
    """
    found: Dict[str, Path] = {}
    missing: List[str] = []
    for arc in archives:
        packed_name = _archive_filename(arc.url)
        unpacked = cache_dir / (packed_name + ".d")

        def lookup(member, unpacked=unpacked):
            return (_find(raw_dir, member) if raw_dir is not None else None) or _find(unpacked, member)

        paths = {m: lookup(m) for m in arc.members}
        if not all(paths.values()):
            if raw_dir is not None:
                packed = _find(raw_dir, packed_name)
            else:
                packed = cache_dir / packed_name
                if not packed.exists():
                    _download(arc.url, packed)
            if packed is not None:
                _check_sha256(packed, arc.sha256)
                _extract(packed, unpacked)
                paths = {m: lookup(m) for m in arc.members}
        for member, path in paths.items():
            if path is None:
                missing.append(f"{member} (from {arc.url})")
            else:
                found[member] = path
    if missing:
        where = f"under {raw_dir}" if raw_dir is not None else f"in the downloads in {cache_dir}"
        raise FileNotFoundError(f"raw files not found {where}:\n  " + "\n  ".join(missing))
    return found


# --------------------------------------------------------------------------- raw formats


def _open_text(path: Path):
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_plain(path: Path) -> List[str]:
    """One sentence per line (Europarl, CommonCrawl, News Commentary, Multi30K, ...)."""
    with _open_text(path) as fh:
        return [line.rstrip("\n").strip() for line in fh]


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


# --------------------------------------------------------------------------- text processing

_CJK = "\u2e80-\u2fdf\u3000-\u303f\u3040-\u30ff\u3100-\u312f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_CJK_CHAR_RE = re.compile(f"([{_CJK}])")

# Sennrich's WMT16 Romanian normalisation (cedilla -> comma below) then diacritics removal,
# the preprocessing of Lee et al. (2018) used by the En-Ro papers.
_RO_TABLE = str.maketrans(
    {"\u015e": "S", "\u015f": "s", "\u0218": "S", "\u0219": "s", "\u0162": "T", "\u0163": "t",
     "\u021a": "T", "\u021b": "t", "\u0102": "A", "\u0103": "a", "\u00c2": "A", "\u00e2": "a",
     "\u00ce": "I", "\u00ee": "i"}
)


ZH_SEGMENTATIONS = ("jieba", "characters")


def segment_chinese(line: str, how: str) -> str:
    """Chinese text into space-separated units: ``jieba`` words (the usual segmenter of MT papers,
    deterministic with its built-in dictionary), or ``characters``: every CJK character alone.
    Latin words and numbers inside Chinese text stay whole either way (Moses and BPE see them)."""
    if how == "characters":
        return _CJK_CHAR_RE.sub(r" \1 ", line)
    if how != "jieba":
        raise ValueError(f"unknown Chinese segmentation {how!r}; choose from {ZH_SEGMENTATIONS}")
    import jieba

    if not jieba.dt.initialized:
        jieba.setLogLevel(logging.WARNING)  # not the dictionary-loading messages of every worker
        jieba.initialize()
    return " ".join(word for word in jieba.cut(line) if word.strip())


_CJK_SPACE_RE = re.compile(f"(?<=[{_CJK}]) +(?=[{_CJK}])")


def unsegment_chinese(line: str) -> str:
    """Undo ``segment_chinese`` in detokenized output: no space between two CJK characters
    (Chinese is written without spaces; sacrebleu's zh tokenizer then splits it for scoring)."""
    return _CJK_SPACE_RE.sub("", line)


@dataclass(frozen=True)
class TextProcessor:
    """Moses punctuation normalisation + tokenization for one language; Chinese is first
    segmented (``zh_segmentation``, see ``segment_chinese``)."""

    lang: str
    lowercase: bool = False
    romanian_strip: bool = False
    zh_segmentation: str = "jieba"

    def __call__(self, line: str) -> str:
        global _MOSES
        if _MOSES is None or _MOSES[0] != self.lang:
            from sacremoses import MosesPunctNormalizer, MosesTokenizer

            _MOSES = (self.lang, MosesPunctNormalizer(lang=self.lang), MosesTokenizer(lang=self.lang))
        _, norm, tok = _MOSES
        line = norm.normalize(line)
        if self.romanian_strip:
            line = line.translate(_RO_TABLE)
        if self.lang == "zh":
            line = segment_chinese(line, self.zh_segmentation)
        out = tok.tokenize(line, escape=False, aggressive_dash_splits=True, return_str=True)
        out = " ".join(out.split())
        return out.lower() if self.lowercase else out


_MOSES = None  # per-process (lang, normalizer, tokenizer)
_BPE = None  # per-process subword-nmt BPE


def _init_bpe(codes: str) -> None:
    global _BPE
    from subword_nmt.apply_bpe import BPE

    with open(codes, encoding="utf-8") as fh:
        _BPE = BPE(fh)


def _apply_bpe(line: str) -> str:
    return _BPE.process_line(line)


def map_lines(fn: Callable[[str], str], lines: List[str], workers: int, what: str,
              initializer=None, initargs=()) -> List[str]:
    """Apply ``fn`` to every line, in ``workers`` processes, with a progress bar and ETA."""
    if workers <= 1:
        if initializer:
            initializer(*initargs)
        it, pool = map(fn, lines), None
    else:
        pool = multiprocessing.get_context("fork").Pool(workers, initializer, initargs)
        it = pool.imap(fn, lines, chunksize=2000)
    out = []
    try:
        with Progress(len(lines), what) as bar:
            for line in it:
                out.append(line)
                bar.update()
        return out
    finally:
        if pool is not None:
            pool.close()
            pool.join()


def keep_clean(src: List[str], tgt: List[str], max_len: int, ratio: float) -> List[int]:
    """Indices of pairs with 1..max_len tokens per side and a length ratio <= ``ratio``
    (the rule of Moses' clean-corpus-n.perl)."""
    keep = []
    for i, (s, t) in enumerate(zip(src, tgt)):
        ls, lt = len(s.split()), len(t.split())
        if 1 <= ls <= max_len and 1 <= lt <= max_len and max(ls, lt) <= ratio * min(ls, lt):
            keep.append(i)
    return keep


def sample_pairs(keep: List[int], n: int, seed: int) -> List[int]:
    """``n`` of the cleaned pairs ``keep``, drawn at random with ``seed``, in corpus order (the same
    sample on every machine from the same raw files)."""
    if n > len(keep):
        raise ValueError(f"a training sample of {n:,} pairs was asked for, but only {len(keep):,} pairs survived "
                         "cleaning: are the raw files complete?")
    log(f"train: a random sample of {n:,} of the {len(keep):,} cleaned pairs (seed {seed})")
    return sorted(random.Random(seed).sample(keep, n))


def sample_record(recipe: "Recipe", train: "Split") -> Dict[str, object]:
    """What prep.json records of a training sample: its size, seed and a sha256 of its raw pairs, to
    compare with another machine's sample."""
    digest = hashlib.sha256()
    for src, tgt in zip(train.src, train.tgt):
        digest.update(f"{src}\t{tgt}\n".encode("utf-8"))
    return {"train_sample": recipe.train_sample, "train_sample_seed": recipe.train_sample_seed,
            "train_sample_sha256": digest.hexdigest()}


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


# --------------------------------------------------------------------------- pipeline


@dataclass
class Split:
    """Raw parallel sentences of one split, optionally with a document id per sentence and where
    the split comes from (recorded in prep.json and beside every score)."""

    src: List[str]
    tgt: List[str]
    docids: Optional[List[str]] = None
    origin: Optional[str] = None

    def __post_init__(self):
        if len(self.src) != len(self.tgt):
            raise ValueError(f"{len(self.src)} source vs {len(self.tgt)} target sentences")
        if self.docids is not None and len(self.docids) != len(self.src):
            raise ValueError("docids not aligned with the sentences")

    def select(self, idx: Sequence[int]) -> "Split":
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return Split(pick(self.src), pick(self.tgt), pick(self.docids) if self.docids else None)


@dataclass
class Recipe:
    """How to turn raw splits into a fairseq data-bin."""

    src: str
    tgt: str
    bpe_merges: int
    joint_bpe: bool = True
    lowercase: bool = False
    romanian_strip: bool = False  # strip Romanian diacritics on the "ro" side
    clean_max_len: int = 250
    clean_ratio: float = 1.5
    valid_every: int = 0  # >0: hold out every n-th cleaned training pair as "valid"
    zh_segmentation: str = "jieba"  # Chinese into words before BPE; or "characters"
    vocab_size: Optional[int] = None  # cap each binarized dictionary at this many types
    train_sample: int = 0  # >0: train on a random sample of this many cleaned pairs (seed ``train_sample_seed``)
    train_sample_seed: int = 1
    extra: Dict[str, object] = field(default_factory=dict)  # recorded in prep.json


def _write(path: Path, lines: List[str]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(line + "\n" for line in lines)


def prepare(name: str, splits: Dict[str, Split], recipe: Recipe, out: Path,
            workers: int = 1, binarize: bool = True) -> Path:
    """Tokenize, clean the training split, learn and apply BPE, write and binarize."""
    if "train" not in splits:
        raise ValueError("a 'train' split is required")
    if recipe.valid_every and "valid" in splits:
        raise ValueError("give either a 'valid' split or valid_every, not both")
    out.mkdir(parents=True, exist_ok=True)
    text_dir = out / "text"
    text_dir.mkdir(exist_ok=True)
    langs = (recipe.src, recipe.tgt)

    def proc(lang):
        return TextProcessor(lang, recipe.lowercase, recipe.romanian_strip and lang == "ro",
                             recipe.zh_segmentation)

    tok: Dict[str, Dict[str, List[str]]] = {}
    for split, data in splits.items():
        tok[split] = {
            lang: map_lines(proc(lang), getattr(data, side), workers, f"tokenize {split}.{lang}")
            for lang, side in zip(langs, ("src", "tgt"))
        }

    keep = keep_clean(tok["train"][recipe.src], tok["train"][recipe.tgt],
                      recipe.clean_max_len, recipe.clean_ratio)
    log(f"train: kept {len(keep)}/{len(splits['train'].src)} pairs after cleaning")
    if not keep:
        raise ValueError("no training pair survived cleaning")
    splits = dict(splits)
    if recipe.train_sample:
        keep = sample_pairs(keep, recipe.train_sample, recipe.train_sample_seed)
    if recipe.valid_every:
        valid_idx = keep[recipe.valid_every - 1 :: recipe.valid_every]
        held = set(valid_idx)
        keep = [i for i in keep if i not in held]
        splits["valid"] = splits["train"].select(valid_idx)
        tok["valid"] = {lang: [tok["train"][lang][i] for i in valid_idx] for lang in langs}
    splits["train"] = splits["train"].select(keep)
    tok["train"] = {lang: [tok["train"][lang][i] for i in keep] for lang in langs}
    if "valid" not in splits:
        raise ValueError("no 'valid' split: give one or set valid_every")

    if recipe.joint_bpe:
        codes = {lang: out / "bpe.codes" for lang in langs}
        learn_bpe([tok["train"][lang] for lang in langs], recipe.bpe_merges, codes[recipe.src])
    else:
        codes = {lang: out / f"bpe.codes.{lang}" for lang in langs}
        for lang in langs:
            learn_bpe([tok["train"][lang]], recipe.bpe_merges, codes[lang])

    for split, data in splits.items():
        for lang, raw in zip(langs, (data.src, data.tgt)):
            bpe = map_lines(_apply_bpe, tok[split][lang], workers, f"bpe {split}.{lang}",
                            _init_bpe, (str(codes[lang]),))
            _write(text_dir / f"{split}.{lang}", bpe)
            if recipe.romanian_strip and lang == "ro":  # references get the same normalisation
                raw = [line.translate(_RO_TABLE) for line in raw]
            _write(out / f"{split}.raw.{lang}", raw)
        if data.docids is not None:
            _write(out / f"{split}.docids", data.docids)

    meta = {
        "corpus": name, "source_lang": recipe.src, "target_lang": recipe.tgt,
        "lowercase": recipe.lowercase, "bpe": "subword-nmt", "bpe_merges": recipe.bpe_merges,
        "joint_bpe": recipe.joint_bpe, "romanian_strip": recipe.romanian_strip,
        "tokenizer": "sacremoses (aggressive dash splits)" + (
            f"; zh segmented: {recipe.zh_segmentation}" if "zh" in langs else ""),
        "zh_segmentation": recipe.zh_segmentation if "zh" in langs else None,
        "vocab_size": recipe.vocab_size,
        **(sample_record(recipe, splits["train"]) if recipe.train_sample else {}),
        "sentences": {s: len(d.src) for s, d in splits.items()},
        "origins": {s: d.origin for s, d in splits.items() if d.origin},
        **recipe.extra,
    }
    (out / "prep.json").write_text(json.dumps(meta, indent=2) + "\n")
    if binarize:
        fairseq_preprocess(text_dir, out, recipe.src, recipe.tgt, list(splits),
                           joined=recipe.joint_bpe, workers=workers, vocab_size=recipe.vocab_size)
    log(f"done: {out}")
    return out


def fairseq_preprocess(text_dir: Path, destdir: Path, src: str, tgt: str, splits: List[str],
                       joined: bool, workers: int = 1, vocab_size: Optional[int] = None) -> None:
    """Binarize ``text_dir/{split}.{lang}`` with the fairseq-preprocess console script; with
    ``vocab_size`` each dictionary keeps at most that many symbols (fairseq's 4 specials included,
    the most frequent types; the rest become <unk>)."""
    exe = shutil.which("fairseq-preprocess")
    if exe is None:
        raise RuntimeError("fairseq-preprocess not found on PATH: install fairseq with fairseq-plugins-install-fairseq")
    cmd = [exe, "--source-lang", src, "--target-lang", tgt, "--destdir", str(destdir),
           "--workers", str(max(1, workers))]
    for split in splits:
        flag = {"train": "--trainpref", "valid": "--validpref", "test": "--testpref"}.get(split)
        if flag is None:
            continue
        cmd += [flag, str(text_dir / split)]
    extra = [s for s in splits if s not in ("train", "valid", "test")]
    if extra:  # fairseq names extra test sets test1, test2, ...; keep ours under their names
        raise ValueError(f"only train/valid/test splits can be binarized, got {extra}")
    if joined:
        cmd.append("--joined-dictionary")
    if vocab_size is not None:
        cmd += ["--nwordssrc", str(vocab_size), "--nwordstgt", str(vocab_size)]
    log("running " + " ".join(cmd))
    subprocess.run(cmd, check=True)



def fairseq_preprocess_only_source(text_dir: Path, destdir: Path, splits: Sequence[str], workers: int = 1) -> None:
    """Binarize monolingual ``text_dir/{split}.txt`` for ``--task language_modeling``
    (``--only-source``: ``dict.txt`` and ``{split}.bin/.idx``; every symbol is kept)."""
    exe = shutil.which("fairseq-preprocess")
    if exe is None:
        raise RuntimeError("fairseq-preprocess not found on PATH: install fairseq with fairseq-plugins-install-fairseq")
    cmd = [exe, "--only-source", "--destdir", str(destdir), "--workers", str(max(1, workers))]
    for split in splits:
        cmd += [{"train": "--trainpref", "valid": "--validpref", "test": "--testpref"}[split],
                str(text_dir / f"{split}.txt")]
    log("running " + " ".join(cmd))
    subprocess.run(cmd, check=True)
