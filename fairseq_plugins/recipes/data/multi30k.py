"""Multi30K task 1 En-De (29k image captions): the small benchmark of the demo and tests.

Raw files are gzip plain text, ``{train,val,test_2016_flickr}.{en,de}.gz``, from
github.com/multi30k/dataset (data/task1/raw) or a local copy with the same names.
"""

from pathlib import Path
from typing import Optional, Sequence

from .common import Recipe, Split
from .download import Archive, locate
from .readers import read_parallel

RAW_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
FILES = [Archive(f"{RAW_URL}/{name}.{lang}.gz", [f"{name}.{lang}"])
         for name in SPLITS.values() for lang in ("en", "de")]


def multi30k_en_de(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """Cased, joint BPE with 8k merges (the demo asks for fewer, for tiny models)."""
    if extra:
        raise ValueError("multi30k-en-de takes no --extra-parallel corpora")
    files = locate(FILES, raw_dir, cache_dir)
    splits = {split: Split(*read_parallel(files[f"{name}.en"], files[f"{name}.de"], f"the {split} split"))
              for split, name in SPLITS.items()}
    return splits, Recipe("en", "de", bpe_merges=8000, clean_max_len=250, clean_ratio=9.0)


CORPORA = {"multi30k-en-de": multi30k_en_de}
