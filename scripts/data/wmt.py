"""WMT news translation corpora: WMT14 En-De (two settings), WMT16 En-Ro, WMT17 Zh-En.

Training text is plain (one sentence per line); dev/test sets are the official
mteval ``.sgm`` files, read with their document ids.
"""

from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .common import Archive, Recipe, Split, locate, read_mteval, read_plain

STATMT = "http://www.statmt.org"
STATMT_DATA = "http://data.statmt.org"

EUROPARL_V7 = Archive(f"{STATMT}/wmt13/training-parallel-europarl-v7.tgz",
                      ["europarl-v7.de-en.de", "europarl-v7.de-en.en"])
COMMONCRAWL = Archive(f"{STATMT}/wmt13/training-parallel-commoncrawl.tgz",
                      ["commoncrawl.de-en.de", "commoncrawl.de-en.en"])
NEWS_COMMENTARY_V9 = Archive(f"{STATMT}/wmt14/training-parallel-nc-v9.tgz",
                             ["news-commentary-v9.de-en.de", "news-commentary-v9.de-en.en"])
NC_V12_URL = f"{STATMT_DATA}/wmt17/translation-task/training-parallel-nc-v12.tgz"
NEWS_COMMENTARY_V12_DE_EN = Archive(NC_V12_URL, ["news-commentary-v12.de-en.de",
                                                 "news-commentary-v12.de-en.en"])
NEWS_COMMENTARY_V12_ZH_EN = Archive(NC_V12_URL, ["news-commentary-v12.zh-en.zh",
                                                 "news-commentary-v12.zh-en.en"])
WMT14_DEV = Archive(f"{STATMT}/wmt14/dev.tgz",
                    ["newstest2013-src.en.sgm", "newstest2013-ref.de.sgm"])
WMT14_TEST = Archive(f"{STATMT}/wmt14/test-full.tgz",
                     ["newstest2014-deen-src.en.sgm", "newstest2014-deen-ref.de.sgm"])

EUROPARL_V8 = Archive(f"{STATMT_DATA}/wmt16/translation-task/training-parallel-ep-v8.tgz",
                      ["europarl-v8.ro-en.en", "europarl-v8.ro-en.ro"])
SETIMES2 = Archive("https://object.pouta.csc.fi/OPUS-SETIMES/v2/moses/en-ro.txt.zip",
                   ["SETIMES.en-ro.en", "SETIMES.en-ro.ro"])
WMT16_DEV = Archive(f"{STATMT_DATA}/wmt16/translation-task/dev-romanian-updated.tgz",
                    ["newsdev2016-enro-src.en.sgm", "newsdev2016-enro-ref.ro.sgm"])
WMT16_TEST = Archive(f"{STATMT_DATA}/wmt16/translation-task/test.tgz",
                     ["newstest2016-enro-src.en.sgm", "newstest2016-enro-ref.ro.sgm"])

WMT17_DEV = Archive(f"{STATMT_DATA}/wmt17/translation-task/dev.tgz",
                    ["newsdev2017-zhen-src.zh.sgm", "newsdev2017-zhen-ref.en.sgm"])
WMT17_TEST = Archive(f"{STATMT_DATA}/wmt17/translation-task/test.tgz",
                     ["newstest2017-zhen-src.zh.sgm", "newstest2017-zhen-ref.en.sgm"])


def _plain_pair(files, prefix: str, src: str, tgt: str) -> Tuple[List[str], List[str]]:
    s, t = read_plain(files[f"{prefix}.{src}"]), read_plain(files[f"{prefix}.{tgt}"])
    if len(s) != len(t):
        raise ValueError(f"{prefix}: {len(s)} {src} lines vs {len(t)} {tgt} lines")
    return s, t


def _training(files, prefixes: Sequence[str], src: str, tgt: str) -> Tuple[List[str], List[str]]:
    src_lines, tgt_lines = [], []
    for prefix in prefixes:
        s, t = _plain_pair(files, prefix, src, tgt)
        src_lines += s
        tgt_lines += t
    return src_lines, tgt_lines


def _sgm_split(files, src_name: str, ref_name: str) -> Split:
    src, ref = read_mteval(files[src_name]), read_mteval(files[ref_name])
    if len(src) != len(ref):
        raise ValueError(f"{src_name}: {len(src)} segments vs {len(ref)} in {ref_name}")
    return Split([s for _, s in src], [r for _, r in ref], [d for d, _ in src])


def _extra_parallel(extra: Sequence[Path], src: str, tgt: str) -> Tuple[List[str], List[str]]:
    """User-supplied corpora given as path prefixes (``PREFIX.{src}`` / ``PREFIX.{tgt}``)."""
    src_lines, tgt_lines = [], []
    for prefix in extra:
        files = {f"{prefix.name}.{lang}": Path(f"{prefix}.{lang}") for lang in (src, tgt)}
        for path in files.values():
            if not path.exists():
                raise FileNotFoundError(f"extra parallel corpus file {path} does not exist")
        s, t = _plain_pair(files, prefix.name, src, tgt)
        src_lines += s
        tgt_lines += t
    return src_lines, tgt_lines


def wmt14_en_de_bpt(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """The Vaswani et al. (2017) setting used by BPT (and by Ott et al. 2018 / TranSFormer):
    Europarl v7 + CommonCrawl + News Commentary v9, newstest2013 valid, newstest2014 test,
    joint BPE with 32k merges."""
    files = locate([EUROPARL_V7, COMMONCRAWL, NEWS_COMMENTARY_V9, WMT14_DEV, WMT14_TEST],
                   raw_dir, cache_dir)
    src, tgt = _training(files, ["europarl-v7.de-en", "commoncrawl.de-en",
                                 "news-commentary-v9.de-en"], "en", "de")
    splits = {
        "train": Split(src, tgt),
        "valid": _sgm_split(files, "newstest2013-src.en.sgm", "newstest2013-ref.de.sgm"),
        "test": _sgm_split(files, "newstest2014-deen-src.en.sgm", "newstest2014-deen-ref.de.sgm"),
    }
    return splits, Recipe("en", "de", bpe_merges=32000, clean_max_len=250, clean_ratio=1.5)


def wmt14_en_de_fairseq(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """fairseq's examples/translation recipe (prepare-wmt14en2de.sh): Europarl v7 +
    CommonCrawl + News Commentary v12, every 100th cleaned pair held out as valid,
    newstest2014 (full) test, joint BPE with 40k merges."""
    files = locate([EUROPARL_V7, COMMONCRAWL, NEWS_COMMENTARY_V12_DE_EN, WMT14_TEST], raw_dir, cache_dir)
    src, tgt = _training(files, ["europarl-v7.de-en", "commoncrawl.de-en",
                                 "news-commentary-v12.de-en"], "en", "de")
    splits = {
        "train": Split(src, tgt),
        "test": _sgm_split(files, "newstest2014-deen-src.en.sgm", "newstest2014-deen-ref.de.sgm"),
    }
    return splits, Recipe("en", "de", bpe_merges=40000, clean_max_len=250, clean_ratio=1.5,
                          valid_every=100)


def wmt16_en_ro(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """Lee et al. (2018) setting: Europarl v8 + SETIMES2, newsdev2016 valid, newstest2016
    test, Romanian diacritics normalised and removed, joint BPE with 40k merges."""
    files = locate([EUROPARL_V8, SETIMES2, WMT16_DEV, WMT16_TEST], raw_dir, cache_dir)
    src, tgt = _training(files, ["europarl-v8.ro-en", "SETIMES.en-ro"], "en", "ro")
    splits = {
        "train": Split(src, tgt),
        "valid": _sgm_split(files, "newsdev2016-enro-src.en.sgm", "newsdev2016-enro-ref.ro.sgm"),
        "test": _sgm_split(files, "newstest2016-enro-src.en.sgm", "newstest2016-enro-ref.ro.sgm"),
    }
    return splits, Recipe("en", "ro", bpe_merges=40000, romanian_strip=True,
                          clean_max_len=250, clean_ratio=1.5)


def wmt17_zh_en(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """WMT17 Zh-En: News Commentary v12 (downloaded) plus the UN and CWMT corpora, which
    need a registration and are passed as ``--extra-parallel PREFIX`` (PREFIX.zh and
    PREFIX.en). newsdev2017 valid, newstest2017 test; separate 32k BPE per language."""
    files = locate([NEWS_COMMENTARY_V12_ZH_EN, WMT17_DEV, WMT17_TEST], raw_dir, cache_dir)
    src, tgt = _plain_pair(files, "news-commentary-v12.zh-en", "zh", "en")
    more_src, more_tgt = _extra_parallel(extra, "zh", "en")
    splits = {
        "train": Split(src + more_src, tgt + more_tgt),
        "valid": _sgm_split(files, "newsdev2017-zhen-src.zh.sgm", "newsdev2017-zhen-ref.en.sgm"),
        "test": _sgm_split(files, "newstest2017-zhen-src.zh.sgm", "newstest2017-zhen-ref.en.sgm"),
    }
    return splits, Recipe("zh", "en", bpe_merges=32000, joint_bpe=False,
                          clean_max_len=250, clean_ratio=9.0)


CORPORA = {
    "wmt14-en-de-bpt": wmt14_en_de_bpt,
    "wmt14-en-de-fairseq": wmt14_en_de_fairseq,
    "wmt16-en-ro": wmt16_en_ro,
    "wmt17-zh-en": wmt17_zh_en,
}
