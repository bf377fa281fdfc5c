"""The pipeline every translation corpus goes through (``prepare``): tokenize (``text_processing``),
clean and sample the training pairs, learn and apply BPE (``bpe``) or sentencepiece
(``sentencepiece_segmentation``), write the text and binarize it
(``binarize``). Finding the raw files is ``download.locate``; reading them, ``readers``.

Layout written under ``out``::

    out/text/{split}.{lang}      tokenized + BPE text, the input of fairseq-preprocess
    out/{split}.raw.{lang}       untokenized text aligned with the binarized split
                                 (the references that sacrebleu scores against)
    out/{split}.docids           one document (TED talk) id per sentence, when known
    out/bpe.codes[.{lang}]       subword-nmt merges (or out/spm.model[.{lang}], sentencepiece's model)
    out/prep.json                what was done (read by fairseq-plugins-evaluate)
    out/dict.*.txt, out/{split}.{src}-{tgt}.{lang}.{bin,idx}   fairseq-preprocess output
"""

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .binarize import fairseq_preprocess
from .bpe import apply_bpe, init_bpe, learn_bpe
from .progress import log, map_lines
from .readers import BadRawData
from .sentencepiece_segmentation import apply_sentencepiece, init_sentencepiece, learn_sentencepiece
from .text_processing import TextProcessor, strip_romanian

# segmentation -> (learn, load in a worker, apply to a line, file of the learnt model)
SEGMENTATIONS = {
    "subword-nmt": (learn_bpe, init_bpe, apply_bpe, "bpe.codes"),
    "sentencepiece": (learn_sentencepiece, init_sentencepiece, apply_sentencepiece, "spm.model"),
}


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
    bpe_merges: int  # subword-nmt merges, or sentencepiece pieces
    joint_bpe: bool = True
    segmentation: str = "subword-nmt"  # or "sentencepiece": a unigram model of ``bpe_merges`` pieces
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
    empty = [split for split, data in splits.items() if not data.src]
    if empty:  # fairseq would write an empty .bin that training cannot open ("cannot mmap an empty file")
        raise BadRawData(f"{name}: the {empty[0]} split is empty" +
                         (f" ({splits[empty[0]].origin})" if splits[empty[0]].origin else ""))
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

    if recipe.segmentation not in SEGMENTATIONS:
        raise ValueError(f"segmentation {recipe.segmentation!r}: one of {', '.join(SEGMENTATIONS)}")
    learn, init, apply, name = SEGMENTATIONS[recipe.segmentation]
    if recipe.joint_bpe:
        codes = {lang: out / name for lang in langs}
        learn([tok["train"][lang] for lang in langs], recipe.bpe_merges, codes[recipe.src])
    else:
        codes = {lang: out / f"{name}.{lang}" for lang in langs}
        for lang in langs:
            learn([tok["train"][lang]], recipe.bpe_merges, codes[lang])

    for split, data in splits.items():
        for lang, raw in zip(langs, (data.src, data.tgt)):
            bpe = map_lines(apply, tok[split][lang], workers, f"{recipe.segmentation} {split}.{lang}",
                            init, (str(codes[lang]),))
            _write(text_dir / f"{split}.{lang}", bpe)
            if recipe.romanian_strip and lang == "ro":  # references get the same normalisation
                raw = [strip_romanian(line) for line in raw]
            _write(out / f"{split}.raw.{lang}", raw)
        if data.docids is not None:
            _write(out / f"{split}.docids", data.docids)

    meta = {
        "corpus": name, "source_lang": recipe.src, "target_lang": recipe.tgt,
        "lowercase": recipe.lowercase, "bpe": recipe.segmentation, "bpe_merges": recipe.bpe_merges,
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
