"""Every sentence classifier against the transformer encoder: same size, same updates, several seeds.

    python -m scripts.classification_study --data data-bin/sst5 --updates 2000 --seeds 1,2,3
    python -m scripts.classification_study --captions --updates 300 --out results/classification_study
    python -m scripts.classification_study --tiny --out /tmp/cs      # seconds: the test suite's run

Each (model, seed) trains with fairseq-train (``sentence_prediction``) for exactly ``--updates``
updates; ``checkpoint_last.pt`` is scored on the test split by the evaluation command's scorer
(``recipes.evaluate_classification``). The report gives each model's test accuracy per seed, the
mean, the sample standard deviation and the range, beside the transformer encoder's.

``--data`` takes any prepared corpus (``fairseq-plugins-prepare-data sst5 ...``). ``--captions``
labels the committed Multi30K fixture's English captions by a rule (does the caption mention a
man, woman, boy or girl?): real sentences with synthetic labels, for a machine without any
labelled corpus.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from fairseq_plugins.recipes.config import USER_DIR
from fairseq_plugins.recipes.data.classification import Corpus, Example, write_corpus
from fairseq_plugins.recipes.data.readers import read_plain
from fairseq_plugins.recipes.evaluate_classification import score_checkpoint

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = REPO / "tests" / "fixtures" / "multi30k"
MODELS = {"transformer_classifier": "Transformer encoder (baseline)", "bpt_classifier": "BPT (k 2, root)",
          "segtree_classifier": "SegTree (root)", "ms_classifier": "Multi-Scale ([CLS] + max-pool)"}
PERSON = {"man", "men", "woman", "women", "boy", "boys", "girl", "girls"}
SIZE = ["--encoder-layers", "2", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
        "--encoder-attention-heads", "4"]  # fmt: skip
TINY_SIZE = ["--encoder-layers", "1", "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
             "--encoder-attention-heads", "2"]  # fmt: skip


def caption_corpus(out: Path, limit: int = 0) -> Path:
    """The Multi30K fixture's English captions, labelled ``person``/``other`` by the rule above."""
    def examples(name):
        lines = read_plain(CAPTIONS / f"{name}.en.gz")
        lines = lines[:limit] if limit else lines
        return [Example(s, "person" if PERSON & set(s.lower().split()) else "other") for s in lines]

    corpus = Corpus({"train": examples("train"), "valid": examples("val"), "test": examples("test_2016_flickr")},
                    "Multi30K English captions (CC BY), labelled by a rule: mentions a man/woman/boy/girl")
    return write_corpus("multi30k-person", corpus, out)


def train(data: Path, save: Path, arch: str, seed: int, updates: int, num_classes: int, size: List[str],
          threads: int) -> Path:
    checkpoint = save / "checkpoint_last.pt"
    if checkpoint.exists():
        return checkpoint  # a finished run is not redone
    cmd = ["fairseq-train", str(data), "--user-dir", str(USER_DIR), "--arch", arch, *size,
           "--task", "sentence_prediction", "--criterion", "sentence_prediction", "--num-classes", str(num_classes),
           "--init-token", "0", "--max-positions", "512", "--optimizer", "adam", "--lr", "0.001",
           "--lr-scheduler", "fixed", "--batch-size", "32", "--dropout", "0.1", "--max-update", str(updates),
           "--max-epoch", "0", "--seed", str(seed), "--save-dir", str(save), "--no-epoch-checkpoints",
           "--no-save-optimizer-state", "--log-format", "simple", "--cpu", "--num-workers", "0"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return checkpoint


def report(results: Dict[str, Dict[int, float]], what: str, updates: int) -> str:
    seeds = sorted(next(iter(results.values())))
    lines = [f"Test accuracy (%) on {what}, {updates} updates, seeds {', '.join(map(str, seeds))}.", "",
             "| Model | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± std | range |",
             "|---|" + "---:|" * (len(seeds) + 2)]
    for arch, per_seed in results.items():
        values = [per_seed[s] for s in seeds]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        lines.append(f"| {MODELS[arch]} | " + " | ".join(f"{v:.2f}" for v in values)
                     + f" | {statistics.fmean(values):.2f} ± {std:.2f} | {min(values):.2f}-{max(values):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", type=Path, help="a prepared sentence_prediction data-bin (with prep.json)")
    source.add_argument("--captions", action="store_true", help="rule-labelled Multi30K captions (committed fixture)")
    source.add_argument("--tiny", action="store_true", help="40 captions, 1-layer 16-d models, 3 updates")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--updates", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("results/classification_study"))
    args = p.parse_args(argv)
    models = args.models.split(",")
    unknown = set(models) - set(MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    updates, size = (3, TINY_SIZE) if args.tiny else (args.updates, SIZE)
    data = args.data or args.out / "data"
    if args.data is None and not (data / "prep.json").exists():
        caption_corpus(data, limit=40 if args.tiny else 0)
    if not (data / "prep.json").exists():
        p.error(f"{data}/prep.json not found: prepare it with fairseq-plugins-prepare-data")
    meta = json.loads((data / "prep.json").read_text())
    results: Dict[str, Dict[int, float]] = {}
    for arch in models:
        for seed in seeds:
            checkpoint = train(data, args.out / "runs" / f"{arch}.seed{seed}", arch, seed, updates,
                               meta["num_classes"], size, args.threads)
            results.setdefault(arch, {})[seed] = score_checkpoint(checkpoint, data)["accuracy"]
            print(f"{arch} seed {seed}: {results[arch][seed]:.2f}", file=sys.stderr, flush=True)
    text = report(results, meta.get("origin", meta["corpus"]), updates)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "classification_study.md").write_text(text, encoding="utf-8")
    (args.out / "classification_study.json").write_text(json.dumps(results, indent=2) + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
