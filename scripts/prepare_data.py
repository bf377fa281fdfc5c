"""Prepare a translation corpus into a fairseq data-bin.

    python -m scripts.prepare_data wmt14-en-de-bpt --out data-bin/wmt14_en_de_bpt
    python -m scripts.prepare_data multi30k-en-de --raw-dir ../shared/data/multi30k --out data-bin/multi30k

Without ``--raw-dir`` the raw files are downloaded from their public sources into
``--cache-dir``; with it, the raw files (extracted, gzipped or still in their archives)
are looked up under that directory and nothing is downloaded.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from .data import iwslt, multi30k, wmt
from .data.common import DEFAULT_CACHE, prepare

CORPORA = {**wmt.CORPORA, **iwslt.CORPORA, **multi30k.CORPORA}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("corpus", choices=sorted(CORPORA))
    p.add_argument("--out", type=Path, required=True, help="data-bin directory to write")
    p.add_argument("--raw-dir", type=Path, help="local copy of the raw files (no download)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where downloads go")
    p.add_argument("--workers", type=int, default=1, help="processes for tokenization/BPE")
    p.add_argument("--bpe-merges", type=int, help="override the recipe's number of BPE merges")
    p.add_argument("--extra-parallel", type=Path, action="append", default=[], metavar="PREFIX",
                   help="more training data as PREFIX.{src} / PREFIX.{tgt} (e.g. UN, CWMT)")
    p.add_argument("--no-binarize", action="store_true", help="stop before fairseq-preprocess")
    return p


def main(argv=None) -> Path:
    args = build_parser().parse_args(argv)
    if args.raw_dir is not None and not args.raw_dir.is_dir():
        sys.exit(f"--raw-dir {args.raw_dir} is not a directory")
    splits, recipe = CORPORA[args.corpus](args.raw_dir, args.cache_dir, args.extra_parallel)
    if args.bpe_merges is not None:
        if args.bpe_merges < 1:
            sys.exit("--bpe-merges must be positive")
        recipe = dataclasses.replace(recipe, bpe_merges=args.bpe_merges)
    return prepare(args.corpus, splits, recipe, args.out, workers=args.workers,
                   binarize=not args.no_binarize)


if __name__ == "__main__":
    main()
