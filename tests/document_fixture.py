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
