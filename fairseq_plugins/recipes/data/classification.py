"""Sentence classification and tagging corpora of the BPT, SegTree and Multi-Scale papers.

Each corpus is read into labelled examples and written in fairseq's ``sentence_prediction``
layout (``input0/``, ``input1/`` for pairs, ``label/``; the ``sequence_tagging`` task reads
the same layout with one tag per word): word-level text (no BPE: the papers feed GloVe word
vectors), one dictionary for both inputs, binarized with ``fairseq-preprocess --only-source``.

Public corpora are downloaded (SST, IMDB, SNLI) and each archive is checked against a pinned
sha256 before it is unpacked (also when it is given packed under ``--raw-dir``). The sources
publish no checksums; the pinned values are the ones HuggingFace ``datasets`` recorded for these
exact archives (``datasets/<name>/dataset_infos.json``, ``download_checksums``), with the byte
sizes recorded beside them. The others have licences that forbid redistribution or need an
account (PTB, CoNLL03, CoNLL12) or no maintained download (MTL-16): without their files under
``--raw-dir`` the command stops and says where to get them; nothing of theirs is downloaded, so
there is nothing to check.

``lowercase`` lowercases the words after tokenization (labels and tags are kept), as BPT's and
SegTree's classifiers read their text (torchtext ``Field(lower=True)``); prep.json records it.
The corpora those papers ran also have lowercased names of their own (``sst5-phrases-lowercase``,
``imdb-lowercase``...), so that a config names its data-bin and a lowercased and a cased
preparation never share a folder.
"""

import json
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .binarize import fairseq_preprocess_only_source
from .download import Archive, find_file, locate
from .progress import log
from .readers import BadRawData

CHECKSUM_SOURCE = "HuggingFace datasets' dataset_infos.json for this archive"
# (url, sha256, bytes): the values of huggingface/datasets, datasets/{sst,imdb,snli}/dataset_infos.json.
# SST's is also the one Flux.jl's Data.Sentiment checks; HuggingFace records IMDB under http://, the same file.
SST = Archive("https://nlp.stanford.edu/sentiment/trainDevTestTrees_PTB.zip", ["train.txt", "dev.txt", "test.txt"],
              "5c613a4f673fc74097d523a2c83f38e0cc462984d847b82c7aaf36b01cbbbfcc")  # 789,539 bytes
IMDB = Archive("https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz", ["imdb.vocab"],
               "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe")  # 84,125,825 bytes
SNLI = Archive("https://nlp.stanford.edu/projects/snli/snli_1.0.zip",
               ["snli_1.0_train.jsonl", "snli_1.0_dev.jsonl", "snli_1.0_test.jsonl"],
               "afb3d70a5af5d8de0d9d81e2637e0fb8c22d1235c2749d83125ca43dab0dbd3e")  # 94,550,081 bytes
MTL16_DOMAINS = {"apparel": "apparel", "baby": "baby", "books": "books", "camera": "camera_photo", "dvd": "dvd",
                 "electronics": "electronics", "health": "health_personal_care", "imdb": "imdb",
                 "kitchen": "kitchen_housewares", "magazines": "magazines", "mr": "MR", "music": "music",
                 "software": "software", "sports": "sports_outdoors", "toys": "toys_games", "video": "video"}
PTB_ESCAPES = {"-LRB-": "(", "-RRB-": ")", "-LSB-": "[", "-RSB-": "]", "-LCB-": "{", "-RCB-": "}"}


@dataclass
class Example:
    """One labelled example: a sentence (or a pair), and a label (or one tag per word)."""

    text: str
    label: str
    text2: Optional[str] = None


@dataclass
class Corpus:
    splits: Dict[str, List[Example]]
    origin: str  # what the data is and where it came from, recorded in prep.json
    extra: Dict[str, object] = field(default_factory=dict)


class RawFilesMissing(FileNotFoundError):
    pass


class DownloadRefused(RawFilesMissing):
    """An archive that is not the published one: refused before it is unpacked."""


def _fetch(archive: Archive, raw_dir, cache_dir) -> Dict[str, Path]:
    """``locate`` one public archive; a checksum mismatch becomes a refusal that names the file."""
    try:
        return locate([archive], raw_dir, cache_dir)
    except ValueError as err:  # locate's sha256 check
        raise DownloadRefused(f"{err} (pinned from {CHECKSUM_SOURCE}: {archive.url})") from err


# ---------------------------------------------------------------- readers


def parse_ptb_tree(line: str) -> List[Tuple[str, List[str]]]:
    """Every subtree of a sentiment treebank line as (label, words), the whole sentence first."""
    tokens = re.findall(r"\(|\)|[^\s()]+", line)
    stack: List[Tuple[str, List[str]]] = []
    phrases: List[Tuple[str, List[str]]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "(":
            stack.append((tokens[i + 1], []))
            i += 2
            continue
        if tok == ")":
            if not stack:
                raise ValueError(f"unbalanced tree: {line[:80]!r}")
            label, words = stack.pop()
            phrases.append((label, words))
            if stack:
                stack[-1][1].extend(words)
        else:
            stack[-1][1].append(PTB_ESCAPES.get(tok, tok))
        i += 1
    if stack or not phrases:
        raise ValueError(f"unbalanced tree: {line[:80]!r}")
    return [phrases[-1]] + phrases[:-1]


def read_sst(path: Path, phrases: bool) -> List[Example]:
    """Fine-grained SST (labels 0-4): whole sentences, or with ``phrases`` every subtree of each tree."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        trees = parse_ptb_tree(line)
        for label, words in trees if phrases else trees[:1]:
            out.append(Example(" ".join(words), label))
    return out


def read_imdb(root: Path, split: str) -> List[Example]:
    """aclImdb/{split}/{pos,neg}/*.txt: one review a file (HTML line breaks become spaces)."""
    out = []
    for label in ("neg", "pos"):
        folder = root / split / label
        if not folder.is_dir():
            raise RawFilesMissing(f"{folder} not found: is {root} the unpacked aclImdb folder?")
        for path in sorted(folder.glob("*.txt")):
            out.append(Example(path.read_text(encoding="utf-8").replace("<br />", " "), label))
    return out


def read_snli(path: Path) -> List[Example]:
    """snli_1.0_*.jsonl; pairs without a gold label ('-': no annotator majority) are left out, as usual."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row["gold_label"] != "-":
            out.append(Example(row["sentence1"], row["gold_label"], row["sentence2"]))
    return out


def read_labelled_lines(path: Path) -> List[Example]:
    """MTL-16 files: ``label<TAB>text`` a line (utf-8, possibly with a byte-order mark)."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        label, sep, text = line.partition("\t")
        if not sep:
            raise ValueError(f"{path}:{n}: expected 'label<TAB>text'")
        out.append(Example(text, label.strip()))
    return out


def read_conll(path: Path, word_column: int = 0, tag_column: int = -1) -> List[Example]:
    """CoNLL column files: a word a line, sentences separated by blank lines; ``-DOCSTART-`` lines skipped."""
    out, words, tags = [], [], []

    def flush():
        if words:
            out.append(Example(" ".join(words), " ".join(tags)))
        words.clear()
        tags.clear()

    for line in path.read_text(encoding="utf-8").splitlines():
        cols = line.split()
        if not cols or line.startswith("#"):
            flush()
            continue
        if cols[0] == "-DOCSTART-":
            continue
        words.append(cols[word_column])
        tags.append(cols[tag_column])
    flush()
    return out


# ---------------------------------------------------------------- corpora


def _sst(raw_dir, cache_dir, phrases: bool) -> Corpus:
    files = _fetch(SST, raw_dir, cache_dir)
    splits = {"train": read_sst(files["train.txt"], phrases), "valid": read_sst(files["dev.txt"], False),
              "test": read_sst(files["test.txt"], False)}
    how = "every phrase of the training trees" if phrases else "whole training sentences"
    return Corpus(splits, f"Stanford Sentiment Treebank, fine-grained (5 classes), trained on {how}; "
                          f"valid/test: whole sentences ({SST.url})", {"phrases": phrases})


def imdb(raw_dir, cache_dir) -> Corpus:
    """25k training reviews, 10% held out (seeded shuffle) for validation as McCann et al. (2017); 25k test."""
    root = _fetch(IMDB, raw_dir, cache_dir)["imdb.vocab"].parent
    train = read_imdb(root, "train")
    random.Random(2345).shuffle(train)
    held = len(train) // 10
    return Corpus({"train": train[held:], "valid": train[:held], "test": read_imdb(root, "test")},
                  f"IMDB (Maas et al., 2011; {IMDB.url}), valid = 10% of train")


def snli(raw_dir, cache_dir) -> Corpus:
    names = {"train": "snli_1.0_train.jsonl", "valid": "snli_1.0_dev.jsonl", "test": "snli_1.0_test.jsonl"}
    files = _fetch(SNLI, raw_dir, cache_dir)
    return Corpus({split: read_snli(files[name]) for split, name in names.items()},
                  f"SNLI 1.0 (Bowman et al., 2015; CC BY-SA 4.0; {SNLI.url})")


def _needs(raw_dir, names: Sequence[str], what: str) -> Dict[str, Path]:
    """Files the user must provide under --raw-dir; the error says what they are and where to get them."""
    found = {name: find_file(raw_dir, name) if raw_dir is not None else None for name in names}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        where = f"under --raw-dir {raw_dir}" if raw_dir is not None else "(no --raw-dir given)"
        raise RawFilesMissing(f"{what}\nMissing {where}: {', '.join(missing)}")
    return found


def mtl16(domain: str) -> Callable:
    def corpus(raw_dir, cache_dir) -> Corpus:
        name = MTL16_DOMAINS[domain]
        files = _needs(raw_dir, [f"{name}.task.train", f"{name}.task.test"], (
            "MTL-16 (Liu, Qiu and Huang, 2017, 'Adversarial Multi-task Learning for Text Classification') is "
            "distributed by its authors, with no licence stated and no maintained download: put the 16 domains' "
            "'<domain>.task.train' and '<domain>.task.test' files (label<TAB>text lines) under --raw-dir."))
        train = read_labelled_lines(files[f"{name}.task.train"])
        if len(train) <= 200:
            raise ValueError(f"{name}.task.train has {len(train)} examples; MTL-16 has 1600 (1400 train + 200 dev)")
        return Corpus({"train": train[:-200], "valid": train[-200:],
                       "test": read_labelled_lines(files[f"{name}.task.test"])},
                      f"MTL-16 {name}: train 1400, dev = the last 200 of .task.train, test 400")
    return corpus


def _licensed_tagging_corpus(raw_dir, names: Dict[str, str], how_to_get: str, origin: str) -> Corpus:
    """A tagging corpus whose licence forbids a download: 'word<TAB>tag' files the user puts under --raw-dir."""
    files = _needs(raw_dir, list(names.values()), how_to_get)
    return Corpus({split: read_conll(files[name]) for split, name in names.items()}, origin)


def ptb_pos(raw_dir, cache_dir) -> Corpus:
    """WSJ sections 0-18 train, 19-21 dev, 22-24 test (the usual POS split), as word/tag columns."""
    return _licensed_tagging_corpus(
        raw_dir, {"train": "ptb-pos.train", "valid": "ptb-pos.dev", "test": "ptb-pos.test"},
        "The Penn Treebank (LDC99T42) is licensed by the Linguistic Data Consortium and may not be redistributed. "
        "With a licence, convert WSJ sections 0-18 / 19-21 / 22-24 to 'word<TAB>tag' lines (blank line between "
        "sentences) and put them under --raw-dir as ptb-pos.train, ptb-pos.dev and ptb-pos.test.",
        "Penn Treebank WSJ POS")


def conll03(raw_dir, cache_dir) -> Corpus:
    return _licensed_tagging_corpus(
        raw_dir, {"train": "eng.train", "valid": "eng.testa", "test": "eng.testb"},
        "CoNLL-2003 English NER is built from the Reuters RCV1 corpus, whose licence (NIST's Reuters Corpus "
        "agreement) forbids redistribution: get RCV1 from NIST, build eng.train / eng.testa / eng.testb with the "
        "shared task's scripts (www.clips.uantwerpen.be/conll2003/ner/), and put them under --raw-dir. Tags are "
        "scored with conlleval's rules (IOB1 files are fine).",
        "CoNLL-2003 English NER")


def conll12(raw_dir, cache_dir) -> Corpus:
    return _licensed_tagging_corpus(
        raw_dir, {"train": "conll12-ner.train", "valid": "conll12-ner.dev", "test": "conll12-ner.test"},
        "CoNLL-2012 NER comes from OntoNotes 5.0 (LDC2013T19), licensed by the Linguistic Data Consortium: with a "
        "licence, build the CoNLL-2012 English train/development/test files, convert the named-entity column to "
        "BIO 'word<TAB>tag' lines (blank line between sentences) and put them under --raw-dir as "
        "conll12-ner.train, conll12-ner.dev and conll12-ner.test.",
        "CoNLL-2012 (OntoNotes 5.0) NER")


CORPORA: Dict[str, Callable] = {
    "sst5": lambda raw, cache: _sst(raw, cache, phrases=False),
    "sst5-phrases": lambda raw, cache: _sst(raw, cache, phrases=True),
    "imdb": imdb, "snli": snli, "ptb-pos": ptb_pos, "conll03-ner": conll03, "conll12-ner": conll12,
    **{f"mtl16-{domain}": mtl16(domain) for domain in MTL16_DOMAINS},
}
TAGGING = ("ptb-pos", "conll03-ner", "conll12-ner")
# the corpora of BPT's and SegTree's original text_classification.py, which lowercases (Field(lower=True))
LOWERCASED = {f"{name}-lowercase": name for name in ("sst5", "sst5-phrases", "imdb")}
CORPORA.update({variant: CORPORA[name] for variant, name in LOWERCASED.items()})


# ---------------------------------------------------------------- writing


def tokenize(text: str) -> str:
    """Moses tokenization (English), case kept (GloVe 840B is cased)."""
    from sacremoses import MosesTokenizer

    return MosesTokenizer(lang="en").tokenize(text, escape=False, return_str=True)


def write_label_dictionary(corpus: Corpus, tagging: bool, path: Path) -> List[str]:
    """The label (tag) dictionary fairseq-preprocess would build from train, plus the labels only
    other splits have: built from train alone, those would be binarized as <unk>, a target of -1
    (an IndexError after a whole epoch, or a score that counts them wrong without a word). Its order
    is fairseq's (count in train, ties alphabetical, padded to a multiple of 8), so a corpus whose
    labels all occur in train gets the dictionary it always had. Returns the labels, sorted."""
    from fairseq.data import Dictionary

    def labels_of(example):
        return example.label.split() if tagging else [example.label]

    dictionary = Dictionary()
    for example in corpus.splits["train"]:
        for label in labels_of(example):
            dictionary.add_symbol(label)
    every = {label for examples in corpus.splits.values() for ex in examples for label in labels_of(ex)}
    for label in sorted(every - set(dictionary.symbols)):
        dictionary.add_symbol(label, n=0)
    dictionary.finalize(threshold=-1, padding_factor=8)
    dictionary.save(str(path))
    return sorted(every)


def write_corpus(name: str, corpus: Corpus, out: Path, binarize: bool = True, workers: int = 1,
                 lowercase: bool = False) -> Path:
    """input0/ (input1/) and label/ text per split under out/text, then fairseq-preprocess."""
    tagging = name in TAGGING
    pretokenized = tagging or name.startswith("sst5")  # treebank and CoNLL words are tokens already
    lowercase = lowercase or name in LOWERCASED
    empty = [split for split, examples in corpus.splits.items() if not examples]
    if empty:
        raise BadRawData(f"{name}: the {empty[0]} split is empty")
    text_dir = out / "text"
    text_dir.mkdir(parents=True, exist_ok=True)
    labels = write_label_dictionary(corpus, tagging, text_dir / "label.dict.txt")
    pairs = any(ex.text2 is not None for exs in corpus.splits.values() for ex in exs)
    for split, examples in corpus.splits.items():
        columns = {"input0": [ex.text for ex in examples], "label": [ex.label for ex in examples]}
        if pairs:
            columns["input1"] = [ex.text2 or "" for ex in examples]
        for key in ("input0", "input1"):
            if key in columns and not pretokenized:
                columns[key] = [tokenize(t) for t in columns[key]]
            if key in columns and lowercase:  # after tokenization, as torchtext's Field(lower=True)
                columns[key] = [t.lower() for t in columns[key]]
        for key, lines in columns.items():
            (text_dir / f"{split}.{key}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        log(f"{name} {split}: {len(examples):,} examples")
    meta = {"corpus": name, "task": "sequence_tagging" if tagging else "sentence_prediction",
            "origin": corpus.origin, "pairs": pairs, "labels": labels, "num_classes": len(labels),
            "examples": {s: len(e) for s, e in corpus.splits.items()}, "lowercase": lowercase, **corpus.extra}
    (out / "prep.json").write_text(json.dumps(meta, indent=2) + "\n")
    if binarize:
        splits = list(corpus.splits)
        _preprocess(text_dir, out / "input0", "input0", splits, workers)
        if pairs:
            _preprocess(text_dir, out / "input1", "input1", splits, workers, srcdict=out / "input0" / "dict.txt")
        _preprocess(text_dir, out / "label", "label", splits, workers, srcdict=text_dir / "label.dict.txt")
    log(f"done: {out}")
    return out


def _preprocess(text_dir: Path, dest: Path, key: str, splits: List[str], workers: int, srcdict: Path = None):
    if dest.exists():
        shutil.rmtree(dest)  # a new preparation: fairseq-preprocess refuses an existing dictionary
    fairseq_preprocess_only_source(text_dir, dest, splits, workers, suffix=f".{key}", srcdict=srcdict)


def prepare(name: str, raw_dir: Optional[Path], cache_dir: Path, out: Path, binarize: bool = True,
            workers: int = 1, lowercase: bool = False) -> Path:
    return write_corpus(name, CORPORA[name](raw_dir, cache_dir), out, binarize, workers, lowercase)
