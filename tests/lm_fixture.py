"""The enwik8 fixture (tests/fixtures/lm/enwik8) prepared at character level, and the tiny
language models the LM tests train on it with the real fairseq-train."""

from pathlib import Path

from fairseq_plugins.recipes import prepare_data
from tests.cli import USER_DIR, run_cli

LM = Path(__file__).resolve().parent / "fixtures" / "lm"
HELDOUT = 3000  # characters of the valid and test splits
TINY = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", "2", "--tokens-per-sample", "64", "--sample-break-mode", "none"]
# the torch backend: "auto" would compile the C++ CPU kernel in each process whose build cache
# another checkout invalidated (minutes); the kernel is tested against it in test_cpu_backend.py
ARCHS = {
    "bpt_lm": ["--graph-k", "2", "--graph-attention-backend", "torch"],
    "segtree_lm": ["--graph-attention-backend", "torch"],
    "window_lm": ["--attention-window", "8"],
    "sparse_lm": ["--sparse-stride", "8", "--sparse-summary", "2", "--graph-attention-backend", "torch"],
}


def prepare_enwik8(out: Path) -> Path:
    """fairseq-plugins-prepare-data enwik8 on the fixture, HELDOUT characters held out: out."""
    return prepare_data.main(["enwik8", "--raw-dir", str(LM / "enwik8"), "--out", str(out),
                              "--heldout-chars", str(HELDOUT)])


def train_lm(data: Path, save: Path, arch: str, updates: int = 8, lr: float = 0.003) -> Path:
    """A tiny ``arch`` trained ``updates`` updates on ``data``; returns ``save`` (checkpoint_last.pt)."""
    run_cli("fairseq-train", data, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", arch,
            *TINY, *ARCHS[arch], "--max-tokens", "512", "--optimizer", "adam", "--lr", str(lr),
            "--max-update", str(updates),
            "--save-dir", save, "--no-epoch-checkpoints", "--cpu", "--num-workers", "0", "--seed", "1")
    return save
