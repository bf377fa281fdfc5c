"""Sentences into what BPE is learnt on: Moses punctuation normalisation and tokenization
(sacremoses), Chinese segmentation (jieba words or characters) and its undoing in output, and
the Romanian normalisation of the En-Ro papers."""

import logging
import re
from dataclasses import dataclass

from fairseq_plugins.command_line import import_extra


_CJK = "\u2e80-\u2fdf\u3000-\u303f\u3040-\u30ff\u3100-\u312f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_CJK_CHAR_RE = re.compile(f"([{_CJK}])")

# Sennrich's WMT16 Romanian normalisation (cedilla -> comma below) then diacritics removal,
# the preprocessing of Lee et al. (2018) used by the En-Ro papers.
_RO_TABLE = str.maketrans(
    {"\u015e": "S", "\u015f": "s", "\u0218": "S", "\u0219": "s", "\u0162": "T", "\u0163": "t",
     "\u021a": "T", "\u021b": "t", "\u0102": "A", "\u0103": "a", "\u00c2": "A", "\u00e2": "a",
     "\u00ce": "I", "\u00ee": "i"}
)


def strip_romanian(line: str) -> str:
    """Romanian without diacritics (the normalisation above), for the tokenizer's input and the references."""
    return line.translate(_RO_TABLE)


ZH_SEGMENTATIONS = ("jieba", "characters")


def segment_chinese(line: str, how: str) -> str:
    """Chinese text into space-separated units: ``jieba`` words (the usual segmenter of MT papers,
    deterministic with its built-in dictionary), or ``characters``: every CJK character alone.
    Latin words and numbers inside Chinese text stay whole either way (Moses and BPE see them)."""
    if how == "characters":
        return _CJK_CHAR_RE.sub(r" \1 ", line)
    if how != "jieba":
        raise ValueError(f"unknown Chinese segmentation {how!r}; choose from {ZH_SEGMENTATIONS}")
    jieba = import_extra("jieba", "zh", "Chinese word segmentation (--zh-segmentation jieba)")
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
            line = strip_romanian(line)
        if self.lang == "zh":
            line = segment_chinese(line, self.zh_segmentation)
        out = tok.tokenize(line, escape=False, aggressive_dash_splits=True, return_str=True)
        out = " ".join(out.split())
        return out.lower() if self.lowercase else out


_MOSES = None  # per-process (lang, normalizer, tokenizer)
