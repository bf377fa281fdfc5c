"""The document-level fixture (tests/fixtures/doc) binarized with the real fairseq-preprocess."""

import shutil
from pathlib import Path

from tests.cli import binarize

FIXTURE = Path(__file__).parent / "fixtures" / "doc"


def binarized_doc_fixture(tmp_path: Path) -> Path:
    """tmp_path/data-bin: fairseq-preprocess output of the fixture plus its {split}.docids."""
    dest = binarize(FIXTURE, Path(tmp_path) / "data-bin")
    for split in ("train", "valid", "test"):
        shutil.copy(FIXTURE / f"{split}.docids", dest / f"{split}.docids")
    return dest


def english_bpe_codes(folder: Path) -> Path:
    """folder/codes: subword-nmt codes learnt on the fixture's English side (as a user's prepare
    step would)."""
    from subword_nmt.learn_bpe import learn_bpe

    codes = Path(folder) / "codes"
    with open(FIXTURE / "train.en", encoding="utf-8") as text, open(codes, "w", encoding="utf-8") as out:
        learn_bpe(text, out, num_symbols=60)
    return codes
