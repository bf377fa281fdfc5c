"""WMT news translation corpora: WMT14 En-De (two settings), WMT16 En-Ro, WMT17 Zh-En.

Training text is plain (one sentence per line), downloaded from statmt.org; dev and test sets
come from sacrebleu's built-in test sets (``.sacrebleu_sets``), with their document ids.
"""

from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .common import Recipe, Split
from .download import Archive, locate
from .readers import read_parallel
from .sacrebleu_sets import sacrebleu_split

STATMT = "http://www.statmt.org"
STATMT_DATA = "http://data.statmt.org"

# sha256 as published in tensorflow_datasets' url_checksums/wmt14_translate.txt
EUROPARL_V7 = Archive(f"{STATMT}/wmt13/training-parallel-europarl-v7.tgz",
                      ["europarl-v7.de-en.de", "europarl-v7.de-en.en"],
                      sha256="0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7")
COMMONCRAWL = Archive(f"{STATMT}/wmt13/training-parallel-commoncrawl.tgz",
                      ["commoncrawl.de-en.de", "commoncrawl.de-en.en"],
                      sha256="c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5")
NEWS_COMMENTARY_V9 = Archive(f"{STATMT}/wmt14/training-parallel-nc-v9.tgz",
                             ["news-commentary-v9.de-en.de", "news-commentary-v9.de-en.en"],
                             sha256="cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485")
NC_V12_URL = f"{STATMT_DATA}/wmt17/translation-task/training-parallel-nc-v12.tgz"
# sha256 as published in tensorflow_datasets' url_checksums/wmt17_translate.txt (168,591,139 bytes)
NC_V12_SHA256 = "2b45f30ef1d550d302fd17dd3a5cbe19134ccc4c2cf50c2dae534aee600101a2"
NEWS_COMMENTARY_V12_DE_EN = Archive(NC_V12_URL, ["news-commentary-v12.de-en.de",
                                                 "news-commentary-v12.de-en.en"], NC_V12_SHA256)
NEWS_COMMENTARY_V12_ZH_EN = Archive(NC_V12_URL, ["news-commentary-v12.zh-en.zh",
                                                 "news-commentary-v12.zh-en.en"], NC_V12_SHA256)

# sha256 as published in tensorflow_datasets' url_checksums/wmt16_translate.txt (225,018,324 bytes;
# the wmt18 folder's training-parallel-ep-v8.tgz is another file)
EUROPARL_V8 = Archive(f"{STATMT_DATA}/wmt16/translation-task/training-parallel-ep-v8.tgz",
                      ["europarl-v8.ro-en.en", "europarl-v8.ro-en.ro"],
                      sha256="8917bd3bef3bc894c8519ca1f8a4c7c330aad08a1263655a9d99ee13d532e3c7")
# no published checksum of OPUS's Moses-format zip (tensorflow_datasets records its TMX file instead)
SETIMES2 = Archive("https://object.pouta.csc.fi/OPUS-SETIMES/v2/moses/en-ro.txt.zip",
                   ["SETIMES.en-ro.en", "SETIMES.en-ro.ro"])


def _plain_pair(files, prefix: str, src: str, tgt: str) -> Tuple[List[str], List[str]]:
    return read_parallel(files[f"{prefix}.{src}"], files[f"{prefix}.{tgt}"], prefix)


def _training(files, prefixes: Sequence[str], src: str, tgt: str) -> Tuple[List[str], List[str]]:
    src_lines, tgt_lines = [], []
    for prefix in prefixes:
        s, t = _plain_pair(files, prefix, src, tgt)
        src_lines += s
        tgt_lines += t
    return src_lines, tgt_lines


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


def _wmt14_training(raw_dir: Optional[Path], cache_dir: Path) -> Split:
    """Europarl v7 + CommonCrawl + News Commentary v9: the 4.5M pairs of Vaswani et al. (2017)."""
    files = locate([EUROPARL_V7, COMMONCRAWL, NEWS_COMMENTARY_V9], raw_dir, cache_dir)
    return Split(*_training(files, ["europarl-v7.de-en", "commoncrawl.de-en",
                                    "news-commentary-v9.de-en"], "en", "de"))


def wmt14_en_de_bpt(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """BPT's setting, that of Vaswani et al. (2017): the 4.5M pairs, newstest2013 valid, joint BPE
    with 32k merges; test = sacrebleu's ``wmt14`` (the filtered newstest2014, 2,737 sentences), the
    set named by the signature in BPT's Table 7 footnote."""
    splits = {"train": _wmt14_training(raw_dir, cache_dir),
              "valid": sacrebleu_split("wmt13", "en-de"),
              "test": sacrebleu_split("wmt14", "en-de")}
    return splits, Recipe("en", "de", bpe_merges=32000, clean_max_len=250, clean_ratio=1.5)


def wmt14_en_de_slowfast(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """TranSFormer's setting (its section 4.1): the 4.5M pairs prepared as Ott et al. (2018), joint
    BPE with 32k merges, newstest2016 valid (as the paper says), test = sacrebleu's
    ``wmt14/full`` (newstest2014, 3,003 sentences, the set of Ott et al.)."""
    splits = {"train": _wmt14_training(raw_dir, cache_dir),
              "valid": sacrebleu_split("wmt16", "en-de"),
              "test": sacrebleu_split("wmt14/full", "en-de")}
    return splits, Recipe("en", "de", bpe_merges=32000, clean_max_len=250, clean_ratio=1.5)


def wmt14_en_de_fairseq(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """fairseq's examples/translation recipe (prepare-wmt14en2de.sh): Europarl v7 +
    CommonCrawl + News Commentary v12, every 100th cleaned pair held out as valid,
    test = sacrebleu's ``wmt14/full``, joint BPE with 40k merges."""
    files = locate([EUROPARL_V7, COMMONCRAWL, NEWS_COMMENTARY_V12_DE_EN], raw_dir, cache_dir)
    src, tgt = _training(files, ["europarl-v7.de-en", "commoncrawl.de-en",
                                 "news-commentary-v12.de-en"], "en", "de")
    splits = {"train": Split(src, tgt), "test": sacrebleu_split("wmt14/full", "en-de")}
    return splits, Recipe("en", "de", bpe_merges=40000, clean_max_len=250, clean_ratio=1.5,
                          valid_every=100)


def wmt16_en_ro(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """Lee et al. (2018) setting: Europarl v8 + SETIMES2, newsdev2016 valid (sacrebleu
    ``wmt16/dev``), newstest2016 test (sacrebleu ``wmt16``), Romanian diacritics normalised and
    removed, joint BPE with 40k merges."""
    files = locate([EUROPARL_V8, SETIMES2], raw_dir, cache_dir)
    src, tgt = _training(files, ["europarl-v8.ro-en", "SETIMES.en-ro"], "en", "ro")
    splits = {"train": Split(src, tgt),
              "valid": sacrebleu_split("wmt16/dev", "en-ro"),
              "test": sacrebleu_split("wmt16", "en-ro")}
    return splits, Recipe("en", "ro", bpe_merges=40000, romanian_strip=True,
                          clean_max_len=250, clean_ratio=1.5)


# TranSFormer section 4.1: UN 15.8M + CWMT 9M + News Commentary 332K pairs, about 18M after the
# filtering of Hassan et al. (2018)
ZH_EN_PAPER_PAIRS = 18_000_000


def wmt17_zh_en(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = (),
                zh_segmentation: str = "jieba"):
    """WMT17 Zh-En: News Commentary v12 (downloaded) plus the UN and CWMT corpora, which
    need a registration and are passed as ``--extra-parallel PREFIX`` (PREFIX.zh and
    PREFIX.en). newsdev2017 valid (sacrebleu ``wmt17/dev``), newstest2017 test (sacrebleu
    ``wmt17``); Chinese segmented into words with jieba, separate 32k BPE per language.

    The paper trains on about 18M pairs (``ZH_EN_PAPER_PAIRS``); fewer are refused by
    fairseq-plugins-prepare-data unless asked for (``--allow-less-training-data``). Cleaning
    here is the length filter of every recipe (at most 250 tokens, ratio 9); Hassan et al.'s
    other filters (language identification, deduplication, alignment scores) are not applied."""
    files = locate([NEWS_COMMENTARY_V12_ZH_EN], raw_dir, cache_dir)
    src, tgt = _plain_pair(files, "news-commentary-v12.zh-en", "zh", "en")
    more_src, more_tgt = _extra_parallel(extra, "zh", "en")
    splits = {
        "train": Split(src + more_src, tgt + more_tgt),
        "valid": sacrebleu_split("wmt17/dev", "zh-en"),
        "test": sacrebleu_split("wmt17", "zh-en"),
    }
    corpora = ["news-commentary-v12.zh-en", *(str(prefix) for prefix in extra)]
    return splits, Recipe("zh", "en", bpe_merges=32000, joint_bpe=False, zh_segmentation=zh_segmentation,
                          clean_max_len=250, clean_ratio=9.0,
                          extra={"training_corpora": corpora, "paper_training_pairs": ZH_EN_PAPER_PAIRS})


def wmt17_zh_en_characters(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """wmt17-zh-en with the Chinese side split into characters (each CJK character one token, no
    BPE on them): the input of TranSFormer Table 2's character-level Transformer-Big."""
    return wmt17_zh_en(raw_dir, cache_dir, extra, zh_segmentation="characters")


CORPORA = {
    "wmt14-en-de-bpt": wmt14_en_de_bpt,
    "wmt14-en-de-slowfast": wmt14_en_de_slowfast,
    "wmt14-en-de-fairseq": wmt14_en_de_fairseq,
    "wmt16-en-ro": wmt16_en_ro,
    "wmt17-zh-en": wmt17_zh_en,
    "wmt17-zh-en-characters": wmt17_zh_en_characters,
}
