"""IWSLT TED talks: IWSLT14 De-En (fairseq's recipe) and IWSLT15 Zh-En (BPT's
document-level setting).

Raw format (WIT3): training text in ``train.tags.{pair}.{lang}`` (plain lines between
``<url>``/``<talkid>``/... metadata lines), dev/test sets in mteval XML
``IWSLT1x.TED.{set}.{pair}.{lang}.xml``. Talk ids are kept and written as
``{split}.docids`` so the document-level task can rebuild each talk.
"""

from pathlib import Path
from typing import List, Optional, Sequence

from .common import Recipe, Split
from .download import Archive, locate
from .readers import parallel_docs, read_mteval, read_ted_tags

IWSLT14_DE_EN_SETS = ["TED.dev2010", "TEDX.dev2012", "TED.tst2010", "TED.tst2011", "TED.tst2012"]
IWSLT14_DE_EN = Archive(
    # the WIT3 original (wit3.fbk.eu/archive/2014-01/texts/de/en/de-en.tgz) is offline;
    # this is fairseq's mirror of the same archive.
    "http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
    ["train.tags.de-en.de", "train.tags.de-en.en"]
    + [f"IWSLT14.{s}.de-en.{lang}.xml" for s in IWSLT14_DE_EN_SETS for lang in ("de", "en")],
)

IWSLT15_ZH_EN_DEV = ["TED.dev2010"]
IWSLT15_ZH_EN_TEST = ["TED.tst2010", "TED.tst2011", "TED.tst2012", "TED.tst2013"]
IWSLT15_ZH_EN = Archive(
    "https://wit3.fbk.eu/archive/2015-01/texts/zh/en/zh-en.tgz",
    ["train.tags.zh-en.zh", "train.tags.zh-en.en"]
    + [f"IWSLT15.{s}.zh-en.{lang}.xml" for s in IWSLT15_ZH_EN_DEV + IWSLT15_ZH_EN_TEST
       for lang in ("zh", "en")],
)


def _train(files, pair: str, src: str, tgt: str, keep_tags: Sequence[str]) -> Split:
    docids, s, t = parallel_docs(
        read_ted_tags(files[f"train.tags.{pair}.{src}"], keep_tags),
        read_ted_tags(files[f"train.tags.{pair}.{tgt}"], keep_tags),
        f"train.tags.{pair}",
    )
    return Split(s, t, docids)


def _xml_sets(files, year: int, sets: List[str], pair: str, src: str, tgt: str) -> Split:
    """Concatenate several evaluation sets; talk ids are prefixed with the set name, since
    talks of different sets are different documents."""
    docids, s, t = [], [], []
    for name in sets:
        prefix = f"IWSLT{year}.{name}.{pair}"
        d, a, b = parallel_docs(read_mteval(files[f"{prefix}.{src}.xml"]),
                                read_mteval(files[f"{prefix}.{tgt}.xml"]), prefix)
        docids += [f"{name}.{x}" for x in d]
        s += a
        t += b
    return Split(s, t, docids, origin=f"IWSLT{year} {pair} {'+'.join(sets)} (WIT3 xml)")


def iwslt14_de_en(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """fairseq's prepare-iwslt14.sh: lowercased, joint BPE with 10k merges, every 23rd
    cleaned training pair held out as valid, test = dev2010 + dev2012 + tst2010-2012."""
    if extra:
        raise ValueError("iwslt14-de-en takes no --extra-parallel corpora")
    files = locate([IWSLT14_DE_EN], raw_dir, cache_dir)
    splits = {
        "train": _train(files, "de-en", "de", "en", keep_tags=("title", "description")),
        "test": _xml_sets(files, 14, IWSLT14_DE_EN_SETS, "de-en", "de", "en"),
    }
    return splits, Recipe("de", "en", bpe_merges=10000, lowercase=True,
                          clean_max_len=175, clean_ratio=1.5, valid_every=23)


def iwslt15_zh_en(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """BPT's document-level setting (after Miculicich et al. 2018): only talk sentences
    (no titles), dev2010 valid, tst2010-2013 test, Chinese segmented into words with jieba,
    separate 30k-merge BPE per language and a 30k vocabulary per language (BPT section 4.3.1).
    Cleaning is permissive (ratio 9) so that talks lose as few sentences as possible."""
    if extra:
        raise ValueError("iwslt15-zh-en takes no --extra-parallel corpora")
    files = locate([IWSLT15_ZH_EN], raw_dir, cache_dir)
    splits = {
        "train": _train(files, "zh-en", "zh", "en", keep_tags=()),
        "valid": _xml_sets(files, 15, IWSLT15_ZH_EN_DEV, "zh-en", "zh", "en"),
        "test": _xml_sets(files, 15, IWSLT15_ZH_EN_TEST, "zh-en", "zh", "en"),
    }
    return splits, Recipe("zh", "en", bpe_merges=30000, joint_bpe=False, vocab_size=30000,
                          clean_max_len=250, clean_ratio=9.0, extra={"docids": True})


CORPORA = {
    "iwslt14-de-en": iwslt14_de_en,
    "iwslt15-zh-en": iwslt15_zh_en,
}
