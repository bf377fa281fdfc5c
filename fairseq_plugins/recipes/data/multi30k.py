"""Multi30K task 1 En-De (29k image captions): the small benchmark of the demo and tests.

Raw files are gzip plain text, ``{train,val,test_2016_flickr}.{en,de}.gz``, from
github.com/multi30k/dataset (data/task1/raw) or a local copy with the same names.
"""

from pathlib import Path
from typing import Optional, Sequence

from .common import Recipe, Split
from .download import Archive, locate
from .readers import read_parallel

# A commit of github.com/multi30k/dataset (its master on 2026-07-07; data/task1/raw last changed in
# c9be912, 2018-01-17), not the moving branch: the files below are fixed by the commit's hash.
COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"
RAW_URL = f"https://raw.githubusercontent.com/multi30k/dataset/{COMMIT}/data/task1/raw"
SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
# sha256 of each file's blob at COMMIT (git cat-file blob COMMIT:data/task1/raw/NAME | sha256sum)
SHA256 = {
    "train.en": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "val.en": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "test_2016_flickr.en": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
}
FILES = [Archive(f"{RAW_URL}/{name}.{lang}.gz", [f"{name}.{lang}"], SHA256[f"{name}.{lang}"])
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
