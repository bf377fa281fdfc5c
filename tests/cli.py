"""Run the real fairseq console scripts on tiny data, for end-to-end tests.

Every model's end-to-end test goes through here, so that all of them exercise the same
path a user takes: ``fairseq-preprocess``, ``fairseq-train --user-dir fairseq_plugins``,
``fairseq-generate --scoring sacrebleu`` and ``fairseq-interactive``, each in its own
process as on the command line.
"""

import gzip
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
USER_DIR = REPO / "fairseq_plugins"
FIXTURES = REPO / "tests" / "fixtures"  # what every test reads (fixtures/README.md)
MULTI30K = FIXTURES / "multi30k"  # the first lines of each split (fixtures/README.md)

# Small enough to train a few dozen updates in seconds on one CPU core. Every model of the
# project subclasses fairseq's transformer and accepts these; later arguments win in argparse,
# so a test can override any of them.
TINY_MODEL_ARGS = [
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]  # fmt: skip

_TOKEN = re.compile(r"\w+|[^\w\s]")


def tokenize(line: str) -> str:
    """Lower-cased word/punctuation split: a tiny closed vocabulary without a BPE step."""
    return " ".join(_TOKEN.findall(line.lower()))


def _read_multi30k(split: str, lang: str, n: int, max_len: int) -> List[str]:
    path = MULTI30K / f"{split}.{lang}.gz"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the checkout is incomplete")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [tokenize(line) for _, line in zip(range(n * 3), f)]


def _pairs(split: str, n: int, max_len: int):
    en = _read_multi30k(split, "en", n, max_len)
    de = _read_multi30k(split, "de", n, max_len)
    pairs = [(s, t) for s, t in zip(en, de) if 0 < len(s.split()) <= max_len and 0 < len(t.split()) <= max_len]
    return pairs[:n]


def run_cli(name: str, *args, timeout: float = 600, input: Optional[str] = None, env=None):
    """Run a console script; on failure raise with the command and the end of its output."""
    exe = shutil.which(name)
    if exe is None:
        raise FileNotFoundError(f"{name} is not on PATH: run scripts/setup.sh first")
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    full_env.update(env or {})
    cmd = [exe, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input, env=full_env)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited with {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}"
            f"\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def write_raw_corpus(raw_dir: Path, n_train: int = 200, n_eval: int = 40, max_len: int = 20) -> Path:
    """Tokenized En-De text from the Multi30K fixture: train/valid/test.{en,de}."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    splits = (("train", "train", n_train), ("valid", "val", n_eval), ("test", "test_2016_flickr", n_eval))
    for split, source, n in splits:
        pairs = _pairs(source, n, max_len)
        (raw_dir / f"{split}.en").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
        (raw_dir / f"{split}.de").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return raw_dir


def binarize(raw_dir: Path, dest: Path, extra_args: Sequence = ()) -> Path:
    """fairseq-preprocess raw_dir/{train,valid,test}.{en,de} into dest (separate dictionaries)."""
    run_cli(
        "fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
        "--trainpref", raw_dir / "train", "--validpref", raw_dir / "valid", "--testpref", raw_dir / "test",
        "--destdir", dest, "--workers", "1", *extra_args,
    )  # fmt: skip
    return dest


def tiny_translation_data(tmp_path: Path, n_train: int = 200, max_len: int = 20) -> Path:
    """Binarized tiny En-De data (separate dictionaries) in tmp_path/data-bin."""
    raw = write_raw_corpus(Path(tmp_path) / "raw", n_train=n_train, max_len=max_len)
    return binarize(raw, Path(tmp_path) / "data-bin")


def train_args(data_bin: Path, save_dir: Path, arch: str, extra_train_args: Sequence = (), max_update: int = 30):
    """The fairseq-train arguments of a tiny model with the plugin loaded, on CPU."""
    return [
        data_bin, "--user-dir", USER_DIR, "--arch", arch, *TINY_MODEL_ARGS,
        "--optimizer", "adam", "--lr", "0.005", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", "1000", "--max-update", max_update, "--save-dir", save_dir,
        "--no-epoch-checkpoints", "--no-progress-bar", "--log-format", "simple", "--log-interval", "5",
        "--num-workers", "0", "--seed", "1", "--cpu", *extra_train_args,
    ]  # fmt: skip


def train(data_bin: Path, save_dir: Path, arch: str, extra_train_args: Sequence = (), max_update: int = 30):
    """fairseq-train a tiny model with the plugin loaded; returns the process (log in stdout)."""
    return run_cli("fairseq-train", *train_args(data_bin, save_dir, arch, extra_train_args, max_update))


def generate(data_bin: Path, checkpoint: Path, extra_args: Sequence = ()) -> str:
    """fairseq-generate the test set with beam 4; returns stdout (hypotheses and the BLEU line)."""
    return run_cli(
        "fairseq-generate", data_bin, "--user-dir", USER_DIR, "--path", checkpoint, "--gen-subset", "test",
        "--beam", "4", "--batch-size", "16", "--scoring", "sacrebleu", "--cpu", "--num-workers", "0",
        *extra_args,
    ).stdout  # fmt: skip


def interactive(data_bin: Path, checkpoint: Path, lines: Iterable[str], extra_args: Sequence = ()) -> str:
    """fairseq-interactive over the given source lines (stdin); returns stdout."""
    return run_cli(
        "fairseq-interactive", data_bin, "--user-dir", USER_DIR, "--path", checkpoint,
        "--source-lang", "en", "--target-lang", "de", "--beam", "4", "--cpu", *extra_args,
        input="".join(line + "\n" for line in lines),
    ).stdout  # fmt: skip


def parse_bleu(generate_out: str) -> float:
    match = re.search(r"BLEU = ([0-9.]+)", generate_out)
    if match is None:
        raise ValueError(f"no BLEU line in fairseq-generate output:\n{generate_out[-2000:]}")
    return float(match.group(1))


def hypotheses(out: str) -> Dict[int, str]:
    """Sentence id -> detokenized hypothesis, from generate/interactive 'H-<id>' lines."""
    result = {}
    for line in out.splitlines():
        if line.startswith("H-"):
            sid, _score, text = (line.split("\t") + ["", ""])[:3]
            result[int(sid[2:])] = text
    return result


def train_and_translate(
    data_bin: Path, save_dir: Path, arch: str, extra_train_args: Sequence = (), max_update: int = 30,
    extra_generate_args: Sequence = (),
) -> dict:
    """Train, then translate with fairseq-generate and fairseq-interactive.

    Returns train_log, generate_out, bleu, interactive_out and checkpoint. Interactive runs on
    the first two lines of the raw test source when it sits beside data_bin (tiny_translation_data).
    """
    log = train(data_bin, save_dir, arch, extra_train_args, max_update=max_update).stdout
    checkpoint = Path(save_dir) / "checkpoint_last.pt"
    if not checkpoint.exists():
        raise FileNotFoundError(f"fairseq-train wrote no {checkpoint}")
    gen = generate(data_bin, checkpoint, extra_generate_args)
    raw_test = Path(data_bin).parent / "raw" / "test.en"
    lines = raw_test.read_text(encoding="utf-8").splitlines()[:2] if raw_test.exists() else ["a man is walking ."]
    inter = interactive(data_bin, checkpoint, lines, extra_generate_args)
    return {"train_log": log, "generate_out": gen, "bleu": parse_bleu(gen), "interactive_out": inter,
            "checkpoint": checkpoint}  # fmt: skip


if __name__ == "__main__":  # manual smoke run: python tests/cli.py ARCH [train args...]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        data = tiny_translation_data(Path(tmp))
        result = train_and_translate(data, Path(tmp) / "ckpt", sys.argv[1] if len(sys.argv) > 1 else "transformer",
                                     sys.argv[2:])  # fmt: skip
        print(result["generate_out"][-500:], result["interactive_out"][-500:], sep="\n")
