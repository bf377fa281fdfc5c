"""The document-level fixture (tests/fixtures/doc) binarized with the real fairseq-preprocess."""

import shutil
from pathlib import Path

from tests.cli import run_cli

FIXTURE = Path(__file__).parent / "fixtures" / "doc"


def binarized_doc_fixture(tmp_path: Path) -> Path:
    """tmp_path/data-bin: fairseq-preprocess output of the fixture plus its {split}.docids."""
    dest = Path(tmp_path) / "data-bin"
    run_cli(
        "fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
        "--trainpref", FIXTURE / "train", "--validpref", FIXTURE / "valid", "--testpref", FIXTURE / "test",
        "--destdir", dest, "--workers", "1",
    )  # fmt: skip
    for split in ("train", "valid", "test"):
        shutil.copy(FIXTURE / f"{split}.docids", dest / f"{split}.docids")
    return dest
