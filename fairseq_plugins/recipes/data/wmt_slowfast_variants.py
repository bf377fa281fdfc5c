"""TranSFormer's WMT14 En-De variants: random low-resource samples of its training pairs (Table 7:
50K, 500K and 1000K pairs), its data with other numbers of BPE merges (Figure 5b) and segmented by
sentencepiece instead of BPE (Table 4d's sentencepiece slow branch).

Both start from ``wmt14-en-de-slowfast`` (same downloads, same valid and test sets). A sample is
drawn from the cleaned pairs with a fixed seed, so every machine with the same raw files trains on
the same pairs; prep.json records the sample's sha256 to compare. The paper says only that the
subsets are "randomly selected" from the WMT En-De training corpus: the seed, sampling after
cleaning, and BPE learnt on the sample itself (32k merges, as the full data) are ours.
"""

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

from .wmt import wmt14_en_de_slowfast

LOW_RESOURCE_PAIRS = {"50k": 50_000, "500k": 500_000, "1000k": 1_000_000}  # Table 7's columns
BPE_MERGES = (10_000, 20_000, 30_000, 40_000, 50_000)  # Figure 5b's axis spans 10K to 50K merges
SAMPLE_SEED = 1


def low_resource(pairs: int):
    def recipe(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
        splits, full = wmt14_en_de_slowfast(raw_dir, cache_dir, extra)
        return splits, dataclasses.replace(full, train_sample=pairs, train_sample_seed=SAMPLE_SEED)

    recipe.__doc__ = f"wmt14-en-de-slowfast trained on a random {pairs:,} of its cleaned pairs (Table 7)."
    return recipe


def bpe_size(merges: int):
    def recipe(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
        splits, full = wmt14_en_de_slowfast(raw_dir, cache_dir, extra)
        return splits, dataclasses.replace(full, bpe_merges=merges)

    recipe.__doc__ = f"wmt14-en-de-slowfast with {merges:,} joint BPE merges (Figure 5b)."
    return recipe


def sentencepiece_segmented(raw_dir: Optional[Path], cache_dir: Path, extra: Sequence[Path] = ()):
    """wmt14-en-de-slowfast segmented by a joint 32k-piece sentencepiece unigram model (Table 4d)."""
    splits, full = wmt14_en_de_slowfast(raw_dir, cache_dir, extra)
    return splits, dataclasses.replace(full, segmentation="sentencepiece")


CORPORA = {
    "wmt14-en-de-slowfast-spm": sentencepiece_segmented,
    **{f"wmt14-en-de-slowfast-{name}": low_resource(pairs) for name, pairs in LOW_RESOURCE_PAIRS.items()},
    **{f"wmt14-en-de-slowfast-bpe{merges // 1000}k": bpe_size(merges) for merges in BPE_MERGES},
}
