"""Every sentence classifier against the transformer encoder: same size, same updates, several seeds.

    python -m scripts.classification_study --data data-bin/sst5 --updates 2000 --seeds 1,2,3
    python -m scripts.classification_study --captions --updates 300 --out results/classification_study
    python -m scripts.classification_study --tiny --out /tmp/cs      # seconds: the test suite's run

Each (model, seed) trains with fairseq-train (``sentence_prediction``) for exactly ``--updates``
updates, Adam with ``--warmup`` updates of linear warm-up then inverse-sqrt decay, the same
schedule for every model; ``checkpoint_last.pt`` is scored on the test split by the evaluation
command's scorer (``recipes.evaluate_classification``). The report gives each model's test
accuracy per seed, the mean, the sample standard deviation and the range, beside the transformer
encoder's and the majority class's rate.

The peak learning rate is ``--lr``, or without it the one of ``--select-lr`` under which the
transformer encoder (the first seed) scores best on the validation split: the test split plays
no part in the choice. (A fixed 1e-3 without warm-up can leave the transformer at the majority
class.)

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
BASELINE = "transformer_classifier"
MODELS = {BASELINE: "Transformer encoder (baseline)", "bpt_classifier": "BPT (k 2, root)",
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
          threads: int, lr: float, warmup: int) -> Path:
    checkpoint = save / "checkpoint_last.pt"
    if checkpoint.exists():
        return checkpoint  # a finished run is not redone
    cmd = ["fairseq-train", str(data), "--user-dir", str(USER_DIR), "--arch", arch, *size,
           "--task", "sentence_prediction", "--criterion", "sentence_prediction", "--num-classes", str(num_classes),
           "--init-token", "0", "--max-positions", "512", "--optimizer", "adam", "--lr", str(lr),
           "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(warmup), "--batch-size", "32",
           "--dropout", "0.1", "--max-update", str(updates),
           "--max-epoch", "0", "--seed", str(seed), "--save-dir", str(save), "--no-epoch-checkpoints",
           "--no-save-optimizer-state", "--log-format", "simple", "--cpu", "--num-workers", "0"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return checkpoint


def majority_rate(data: Path, split: str = "test") -> float:
    """The accuracy (%) of always answering the split's most frequent label."""
    labels = (data / "text" / f"{split}.label").read_text(encoding="utf-8").split()
    return 100.0 * max(labels.count(label) for label in set(labels)) / len(labels)


def report(results: Dict[str, Dict[int, float]], what: str, updates: int, majority: float, schedule: str) -> str:
    seeds = sorted(next(iter(results.values())))
    lines = [f"Test accuracy (%) on {what}, {updates} updates ({schedule}), seeds {', '.join(map(str, seeds))}; "
             f"the majority class scores {majority:.2f}.", "",
             "| Model | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± std | range |",
             "|---|" + "---:|" * (len(seeds) + 2)]
    for arch, per_seed in results.items():
        values = [per_seed[s] for s in seeds]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        lines.append(f"| {MODELS[arch]} | " + " | ".join(f"{v:.2f}" for v in values)
                     + f" | {statistics.fmean(values):.2f} ± {std:.2f} | {min(values):.2f}-{max(values):.2f} |")
    lines.append("| majority class | " + " | ".join(f"{majority:.2f}" for _ in seeds)
                 + f" | {majority:.2f} | {majority:.2f} |")
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
    p.add_argument("--lr", type=float, help="peak learning rate (default: chosen from --select-lr)")
    p.add_argument("--select-lr", default="0.0005,0.001,0.002",
                   help="peak learning rates tried on the transformer encoder, first seed; the best on the "
                        "validation split is used for every model (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=40, help="linear warm-up updates before the inverse-sqrt decay")
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
    loads = []

    def run(arch: str, seed: int, lr: float) -> Path:
        loads.append(os.getloadavg()[0])
        return train(data, args.out / "runs" / f"{arch}.lr{lr:g}.seed{seed}", arch, seed, updates,
                     meta["num_classes"], size, args.threads, lr, args.warmup)

    selection = {}
    if args.lr is None:  # the transformer's best on the validation split; the test split is not looked at
        for lr in (float(x) for x in args.select_lr.split(",")):
            selection[lr] = score_checkpoint(run(BASELINE, seeds[0], lr), data, "valid")["accuracy"]
            print(f"{BASELINE} seed {seeds[0]} lr {lr:g}: valid {selection[lr]:.2f}", file=sys.stderr, flush=True)
    lr = args.lr if args.lr is not None else max(selection, key=selection.get)
    results: Dict[str, Dict[int, float]] = {}
    for arch in models:
        for seed in seeds:
            results.setdefault(arch, {})[seed] = score_checkpoint(run(arch, seed, lr), data)["accuracy"]
            print(f"{arch} seed {seed}: {results[arch][seed]:.2f}", file=sys.stderr, flush=True)
    majority = majority_rate(data)
    schedule = f"Adam, lr {lr:g} after {args.warmup} warm-up updates, inverse-sqrt decay"
    text = report(results, meta.get("origin", meta["corpus"]), updates, majority, schedule)
    load = {"mean": statistics.fmean(loads), "max": max(loads)}
    text += (f"\nMade with `python -m scripts.classification_study {' '.join(sys.argv[1:] if argv is None else argv)}`"
             f" on {os.cpu_count()} cores, {args.threads} thread(s) per run; the 1-minute load average at the "
             f"runs' starts was {load['mean']:.1f} on average (max {load['max']:.1f}).\n")
    if selection:
        text += (f"\nThe lr: the transformer encoder's validation accuracy (seed {seeds[0]}) at "
                 + ", ".join(f"{k:g}: {v:.2f}" for k, v in selection.items())
                 + f"; the best, {lr:g}, for every model.\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "classification_study.md").write_text(text, encoding="utf-8")
    (args.out / "classification_study.json").write_text(json.dumps(
        {"updates": updates, "lr": lr, "warmup": args.warmup, "lr_selection_valid": selection,
         "majority_class_test": majority, "load": load, "test_accuracy": results}, indent=2) + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
