"""Prepare a translation or language-modelling corpus into a fairseq data-bin.

    fairseq-plugins-prepare-data wmt14-en-de-bpt --out data-bin/wmt14_en_de_bpt
    fairseq-plugins-prepare-data multi30k-en-de --raw-dir path/to/multi30k --out data-bin/multi30k
    fairseq-plugins-prepare-data sst5-phrases --out data-bin/sst5-phrases    # classification: word level, no BPE
    fairseq-plugins-prepare-data sst5-phrases-lowercase --out data-bin/sst5-phrases-lowercase   # lowercased
    fairseq-plugins-prepare-data enwik8 --out data-bin/enwik8     (also text8, ptb, wikitext-2)
    fairseq-plugins-prepare-data text --raw-dir my_text.txt --out data-bin/my_text   # your own text (or a folder)

Without ``--raw-dir`` the raw training files are downloaded from their public sources into
``--cache-dir``; with it, the raw files (extracted, gzipped or still in their archives)
are looked up under that directory and nothing is downloaded. WMT dev/test sets come from
sacrebleu's test sets (its cache: the SACREBLEU environment variable, default ~/.sacrebleu).
Chinese is segmented into words with jieba before BPE (``--zh-segmentation characters``: one
token per character instead).
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from ..command_line import command_parser
from .data import classification, iwslt, language_modeling, multi30k, wmt, wmt_slowfast_variants
from .data.common import prepare
from .data.download import DEFAULT_CACHE
from .data.readers import BadRawData
from .data.text_processing import ZH_SEGMENTATIONS

CORPORA = {**wmt.CORPORA, **wmt_slowfast_variants.CORPORA, **iwslt.CORPORA, **multi30k.CORPORA,
           **classification.CORPORA}
LM_CORPORA = language_modeling.CORPORA
TRANSLATION_ONLY = ("bpe_merges", "vocab_size", "zh_segmentation", "extra_parallel")



def build_parser() -> argparse.ArgumentParser:
    p = command_parser(description=__doc__)
    p.add_argument("corpus", choices=sorted({**CORPORA, **LM_CORPORA}), help="the corpus to prepare")
    p.add_argument("--out", type=Path, required=True, help="data-bin directory to write")
    p.add_argument("--raw-dir", type=Path, help="local copy of the raw files (no download)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where downloads go")
    p.add_argument("--workers", type=int, default=1, help="processes for tokenization/BPE")
    p.add_argument("--bpe-merges", type=int, help="override the recipe's number of BPE merges")
    p.add_argument("--vocab-size", type=int, help="override the recipe's cap on each dictionary")
    p.add_argument("--zh-segmentation", choices=ZH_SEGMENTATIONS,
                   help="override how Chinese is split before BPE (default: the recipe's, jieba)")
    p.add_argument("--extra-parallel", type=Path, action="append", default=[], metavar="PREFIX",
                   help="more training data as PREFIX.{src} / PREFIX.{tgt} (e.g. UN, CWMT)")
    p.add_argument("--allow-less-training-data", action="store_true",
                   help="prepare a corpus with fewer training pairs than the paper trained on (e.g. wmt17-zh-en "
                        "without the UN and CWMT corpora); the pair count is recorded beside every score")
    p.add_argument("--lowercase", action="store_true",
                   help="classification and word-level language-modelling corpora: lowercase the words (after "
                        "tokenization; the *-lowercase corpora always are); recorded in prep.json")
    p.add_argument("--no-binarize", action="store_true", help="stop before fairseq-preprocess")
    p.add_argument("--heldout-chars", type=int,
                   help="enwik8/text8/text: symbols in each of valid and test (default: the standard 5M; "
                        "text: 1/20 of the text each)")
    p.add_argument("--unit", choices=language_modeling.character_tokens.UNITS,
                   help="text: one token per character (default) or per UTF-8 byte")
    return p


def check_training_size(corpus: str, pairs: int, recipe, allowed: bool) -> None:
    """Refuse a corpus far smaller than the paper's training data unless asked for (tables
    would land several BLEU low without saying why)."""
    paper = recipe.extra.get("paper_training_pairs")
    if paper is None or pairs >= paper // 2:
        return
    message = (f"{corpus}: {pairs:,} training pairs ({', '.join(recipe.extra['training_corpora'])}), about "
               f"1/{round(paper / max(pairs, 1))} of the {paper:,} the paper trained on")
    if not allowed:
        sys.exit(f"{message}. Add the UN and CWMT corpora (they need a registration) with --extra-parallel PREFIX, "
                 "or prepare this smaller corpus on purpose with --allow-less-training-data (the pair count is "
                 "recorded beside every score)")
    print(f"[prepare] {message}: --allow-less-training-data given", file=sys.stderr, flush=True)


def main(argv=None) -> Path:
    args = build_parser().parse_args(argv)
    try:
        return _prepare(args)
    except (classification.RawFilesMissing, BadRawData) as err:  # the message is all there is to say
        sys.exit(str(err))


def _prepare(args) -> Path:
    if args.raw_dir is not None and not args.raw_dir.is_dir() and args.corpus != "text":
        sys.exit(f"--raw-dir {args.raw_dir} is not a directory")
    if args.corpus in classification.CORPORA:  # word-level sentence_prediction / sequence_tagging layout
        return classification.prepare(args.corpus, args.raw_dir, args.cache_dir, args.out,
                                      binarize=not args.no_binarize, workers=args.workers, lowercase=args.lowercase)
    if args.corpus in LM_CORPORA:
        given = [name for name in TRANSLATION_ONLY if getattr(args, name) not in (None, [], False)]
        if given:
            sys.exit(f"{args.corpus} is a language-modelling corpus: "
                     f"{', '.join('--' + n.replace('_', '-') for n in given)} do not apply")
        try:
            return language_modeling.prepare(args.corpus, args.raw_dir, args.cache_dir, args.out, workers=args.workers,
                                             binarize=not args.no_binarize, heldout_chars=args.heldout_chars,
                                             unit=args.unit, lowercase=args.lowercase)
        except ValueError as err:
            sys.exit(f"{args.corpus}: {err}")
    if args.lowercase:
        sys.exit(f"--lowercase is for classification and word-level LM corpora: {args.corpus} is translated "
                 f"with its recipe's case")
    splits, recipe = CORPORA[args.corpus](args.raw_dir, args.cache_dir, args.extra_parallel)
    check_training_size(args.corpus, len(splits["train"].src), recipe, args.allow_less_training_data)
    if args.bpe_merges is not None:
        if args.bpe_merges < 1:
            sys.exit("--bpe-merges must be positive")
        recipe = dataclasses.replace(recipe, bpe_merges=args.bpe_merges)
    if args.vocab_size is not None:
        if args.vocab_size < 5:
            sys.exit("--vocab-size must be at least 5 (fairseq's 4 special symbols + 1)")
        recipe = dataclasses.replace(recipe, vocab_size=args.vocab_size)
    if args.zh_segmentation is not None:
        if "zh" not in (recipe.src, recipe.tgt):
            sys.exit(f"--zh-segmentation: {args.corpus} has no Chinese side")
        recipe = dataclasses.replace(recipe, zh_segmentation=args.zh_segmentation)
    return prepare(args.corpus, splits, recipe, args.out, workers=args.workers,
                   binarize=not args.no_binarize)


if __name__ == "__main__":
    main()
