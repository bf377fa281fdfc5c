"""Character-level language models on real English text: every plugin LM against
``transformer_lm`` of the same size, over several seeds, on CPU, with nothing to download.

    python -m fairseq_plugins.recipes.lm_study --out results/lm_study   # context 2048, 5 models x 3 seeds
    python -m fairseq_plugins.recipes.lm_study --context 256 --max-tokens 1024 --updates 120 \
        --rounds 1 --checkpoint-interval 10 --lr 0.003 --window 32 --stride 16 \
        --heldout-chars 10240 --threads 1                                # benchmarks/lm_study.md's run
    fairseq-plugins-demo --lm                            # BPT and the transformer only, one seed

The corpus is the Python Language Reference and library topics that every CPython ships for
``help()`` (``pydoc_data.topics``, PSF License): about 0.45 M characters of English technical
prose with grammar rules and code examples between the paragraphs, read offline from the
running interpreter (its text changes a little between Python versions: the version and the
text's sha256 are recorded). Topics are joined in sorted order; the last ``2 x --heldout-chars``
characters are valid then test.

One token per character (its code point, so that no character needs escaping; the newline is a
character like the others, ``fairseq_plugins.data.character_tokens``), one ``</s>`` at the end
of the text: ``fairseq-eval-lm``'s loss in base 2 over the test split is bits per character,
every character counted once (plus that ``</s>``).

Every plugin LM (``--models``: ``bpt_lm``, ``segtree_lm``, ``window_lm``, ``sparse_lm``, each
at the same sizes as the baseline, pre-norm like it) trains with ``fairseq-train`` for the same
``--updates`` on the same batches (``--tokens-per-sample`` characters per sequence,
``--max-tokens`` per update) beside ``transformer_lm``, once per seed of ``--seeds``, in
``--rounds`` rounds that alternate the models (each round resumes from ``checkpoint_last.pt``;
the order flips every round and every seed), so that other jobs on a shared machine slow all
alike. Training speed is the median of fairseq's ``wps`` (tokens per second) over a round's
progress lines; the ratio model / transformer is taken per round.

Two held-out scores per model and seed (``fairseq-eval-lm`` on the test split in
non-overlapping blocks of the training context):

* **equal updates:** ``checkpoint_last.pt`` after ``--updates``;
* **equal time:** the checkpoint the model reaches in the time the transformer needed for
  ``--updates``, the time converted into updates by the speed ratio measured in the same rounds
  (``updates x ratio``, the median over that seed's rounds), rounded down to the checkpoints
  kept every ``--checkpoint-interval`` updates; a faster model trains on (resumed) up to that
  count, at most ``--max-time-factor x --updates``. Wall-clock limits (``--stop-time-hours``)
  would measure the other jobs of a shared machine rather than the model; the inverse-sqrt
  schedule does not depend on the run's length, so the checkpoint at n updates is the model a run
  of n updates would give.

Each score is reported as the mean and sample standard deviation over the seeds.
"""

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from fairseq_plugins.data import character_tokens

from ..command_line import command_parser
from .config import USER_DIR
from .data import language_modeling
from .evaluate_lm import parse as parse_eval_lm
from .tools import Tools
from .train_log import model_params, progress

CORPUS = "Python Language Reference topics (pydoc_data.topics, shipped with CPython; PSF License)"
BASELINE = "transformer_lm"
ALL_MODELS = (BASELINE, "bpt_lm", "segtree_lm", "window_lm", "sparse_lm")


def python_docs_text() -> str:
    """The help() topics of the running Python, in sorted order, one blank line between them."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip("\n") for name in sorted(topics)) + "\n"


def prepare_corpus(out: Path, heldout_chars: int) -> Path:
    """Write the data-bin and ``prep.json`` under ``out`` (reused if of this format and size)."""
    prep = out / "prep.json"
    if prep.exists():
        meta = json.loads(prep.read_text())
        if meta["heldout"] == heldout_chars and meta.get("format") == language_modeling.FORMAT:
            return out
    text = python_docs_text()
    counts = language_modeling.binarize_documents([character_tokens.symbols(text, "characters")], out, heldout_chars)
    language_modeling.write_prep(out, {
        "corpus": CORPUS, "python": sys.version.split()[0], "unit": "characters", "metric": "bpc",
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "heldout": heldout_chars,
        "symbols": {split: c["symbols"] for split, c in counts.items()}})
    return out


def model_flags(args) -> Dict[str, List[str]]:
    """The models of ``--models``, the baseline first: the same sizes, all pre-norm
    (``transformer_lm_matched`` for the baseline); the graph models with their relative positions
    only, as their papers."""
    size = ["--decoder-layers", str(args.layers), "--decoder-embed-dim", str(args.dim),
            "--decoder-ffn-embed-dim", str(4 * args.dim), "--decoder-attention-heads", str(args.heads),
            "--dropout", str(args.dropout)]
    backend = ["--graph-attention-backend", args.backend]
    every = {BASELINE: (BASELINE, ["--arch", "transformer_lm_matched", *size]),
             "bpt_lm": (f"bpt_lm k{args.k}", ["--arch", "bpt_lm", *size, "--graph-k", str(args.k), *backend]),
             "segtree_lm": ("segtree_lm", ["--arch", "segtree_lm", *size, *backend]),
             "window_lm": (f"window_lm w{args.window}",
                           ["--arch", "window_lm", *size, "--attention-window", str(args.window)]),
             "sparse_lm": (f"sparse_lm s{args.stride}",
                           ["--arch", "sparse_lm", *size, "--sparse-stride", str(args.stride), *backend])}
    unknown = sorted(set(args.models) - set(every))
    if unknown:
        raise ValueError(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(every)}")
    return dict(every[m] for m in [BASELINE, *(m for m in every if m in args.models and m != BASELINE)])


def _exe(name: str) -> str:
    return Tools()(name)


def _env(args) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))


def train_round(data: Path, save_dir: Path, flags: List[str], args, seed: int, until: int) -> dict:
    """fairseq-train up to ``until`` updates, resuming from ``save_dir/checkpoint_last.pt``; a
    checkpoint kept every ``--checkpoint-interval`` updates for the equal-time scores."""
    cmd = [_exe("fairseq-train"), str(data), "--user-dir", str(USER_DIR), "--task", "language_modeling", *flags,
           "--tokens-per-sample", str(args.context), "--sample-break-mode", "none",
           "--max-tokens", str(args.max_tokens), "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
           "--lr", str(args.lr), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(args.warmup),
           "--clip-norm", "1.0", "--max-update", str(until), "--disable-validation", "--no-epoch-checkpoints",
           "--save-interval-updates", str(args.checkpoint_interval),
           "--save-dir", str(save_dir), "--seed", str(seed), "--num-workers", "0",
           "--log-format", "simple", "--log-interval", str(args.log_interval), "--cpu"]
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(args))
    seconds = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    save_dir.mkdir(parents=True, exist_ok=True)
    with open(save_dir / "train.log", "a", encoding="utf-8") as fh:
        fh.write(log)
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-train failed:\n{' '.join(cmd)}\n{log[-4000:]}")
    lines = progress(log)
    if not lines:
        raise RuntimeError(f"no training progress line in {save_dir / 'train.log'}: lower --log-interval")
    return {"until": until, "updates_done": max(updates for _, updates in lines),
            "tokens_per_second": statistics.median(wps for wps, _ in lines), "seconds": seconds,
            "load": (load + os.getloadavg()[0]) / 2, "params": model_params(log)}


def evaluate(data: Path, checkpoint: Path, args) -> dict:
    """Test bpc in non-overlapping blocks of the training context."""
    cmd = [_exe("fairseq-eval-lm"), str(data), "--user-dir", str(USER_DIR), "--path", str(checkpoint),
           "--gen-subset", "test", "--tokens-per-sample", str(args.context), "--max-tokens", str(args.max_tokens),
           "--num-workers", "0", "--cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(args))
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-eval-lm failed:\n{proc.stderr[-4000:]}")
    scores = parse_eval_lm(proc.stdout + proc.stderr)
    return {"bpc": scores["loss_base2"], "test_tokens": scores["tokens"],
            "eval_tokens_per_second": scores["tokens_per_second"]}


def round_targets(updates: int, rounds: int) -> List[int]:
    """The update count each round trains up to: ``rounds`` near-equal steps ending at ``updates``."""
    if rounds < 1 or updates < rounds:
        raise ValueError(f"{updates} updates cannot be split into {rounds} rounds")
    return [round(updates * (r + 1) / rounds) for r in range(rounds)]


def equal_time_updates(updates: int, speed_ratio: float, interval: int, max_factor: float) -> int:
    """The last kept checkpoint (``updates`` or a multiple of ``interval``) within the updates a
    model of ``speed_ratio`` x the transformer's speed makes in the transformer's time for
    ``updates``; 0 when that time ends before the first checkpoint kept."""
    budget = min(updates * speed_ratio, updates * max_factor)
    kept = [u for u in range(interval, int(budget) + 1, interval)] + ([updates] if updates <= budget else [])
    return max(kept, default=0)


def _checkpoint_at(run: Path, updates: int) -> Path:
    found = sorted(run.glob(f"checkpoint_*_{updates}.pt"))
    if not found:
        raise FileNotFoundError(f"no checkpoint of {updates} updates in {run}")
    return found[0]


def train_seed(data: Path, models: Dict[str, List[str]], args, seed: int, index: int, say=print) -> Dict[str, dict]:
    """One seed: every model to ``--updates`` in alternating rounds (the order flipped every round
    and every seed) and scored; then each model's equal-time checkpoint, trained on where needed."""
    runs = {name: args.out / "runs" / f"seed{seed}" / name.replace(" ", "_") for name in models}
    rounds: Dict[str, List[dict]] = {name: [] for name in models}
    for r, until in enumerate(round_targets(args.updates, args.rounds)):
        order = list(models) if (r + index) % 2 == 0 else list(models)[::-1]
        for name in order:
            rounds[name].append(train_round(data, runs[name], models[name], args, seed, until))
            say(f"[lm] seed {seed} round {r + 1}/{args.rounds} {name}: {until} updates, "
                f"{rounds[name][-1]['tokens_per_second']:.0f} tokens/s, load {rounds[name][-1]['load']:.1f}")
    results = {}
    for name in models:
        ratios = [x["tokens_per_second"] / b["tokens_per_second"] for x, b in zip(rounds[name], rounds[BASELINE])]
        results[name] = {"seed": seed, "rounds": rounds[name], "speed_vs_baseline_per_round": ratios,
                         "equal_updates": evaluate(data, runs[name] / "checkpoint_last.pt", args)}
    for name in models:
        target = equal_time_updates(args.updates, statistics.median(results[name]["speed_vs_baseline_per_round"]),
                                    args.checkpoint_interval, args.max_time_factor)
        if target > args.updates:
            results[name]["extension"] = train_round(data, runs[name], models[name], args, seed, target)
        scores = (results[name]["equal_updates"] if target == args.updates else {"bpc": None} if target == 0 else
                  evaluate(data, runs[name] / "checkpoint_last.pt" if target > args.updates
                           else _checkpoint_at(runs[name], target), args))
        results[name]["equal_time"] = {"updates": target, **scores}
        for kept in runs[name].glob("checkpoint_*_*.pt"):  # scored: only checkpoint_last stays
            kept.unlink()
        say(f"[lm] seed {seed} {name}: test bpc {results[name]['equal_updates']['bpc']:.3f} at {args.updates} "
            f"updates, {_bpc(scores['bpc'])} at {target} (equal time)")
    return results


def _bpc(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def mean_sd(values: List[float]) -> Dict[str, float]:
    """The mean and the sample standard deviation (0 for one value) of ``values``; both None when
    a value is missing (a seed whose equal time ended before its first checkpoint)."""
    if any(v is None for v in values):
        return {"mean": None, "sd": None}
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarise(name: str, per_seed: List[dict], updates: int) -> dict:
    """A model's row from its seeds' results: bpc at equal updates and at equal time (mean and
    sd over seeds), speed over every round of every seed."""
    rounds = [x for s in per_seed for x in s["rounds"]]
    ratios = [x for s in per_seed for x in s["speed_vs_baseline_per_round"]]
    equal_updates = mean_sd([s["equal_updates"]["bpc"] for s in per_seed])
    return {"model": name, "params": rounds[0]["params"], "updates": updates, "seeds": [s["seed"] for s in per_seed],
            "bpc": equal_updates["mean"], "bpc_sd": equal_updates["sd"],
            "test_tokens": per_seed[0]["equal_updates"]["test_tokens"],
            "eval_tokens_per_second": statistics.median(s["equal_updates"]["eval_tokens_per_second"]
                                                        for s in per_seed),
            "equal_time": {"updates": [s["equal_time"]["updates"] for s in per_seed],
                           "bpc": mean_sd([s["equal_time"]["bpc"] for s in per_seed])},
            "tokens_per_second": statistics.median(x["tokens_per_second"] for x in rounds),
            "speed_vs_baseline": statistics.median(ratios), "speed_vs_baseline_per_round": ratios,
            "rounds": rounds, "per_seed": per_seed}


def run_study(args, say=print) -> dict:
    args.checkpoint_interval = args.checkpoint_interval or max(1, args.updates // 20)
    data = prepare_corpus(args.out / "data-bin", args.heldout_chars)
    models = model_flags(args)
    if args.out.joinpath("runs").exists():  # fairseq would resume from an earlier study's checkpoints
        shutil.rmtree(args.out / "runs")
    start = time.monotonic()
    per_seed: Dict[str, List[dict]] = {name: [] for name in models}
    for index, seed in enumerate(args.seeds):
        for name, result in train_seed(data, models, args, seed, index, say).items():
            per_seed[name].append(result)
    rows = [summarise(name, per_seed[name], args.updates) for name in models]
    loads = [x["load"] for row in rows for x in row["rounds"]]
    meta = json.loads((data / "prep.json").read_text())
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"corpus": meta, "settings": settings, "cores": os.cpu_count(),
              "load": {"mean": statistics.mean(loads), "max": max(loads)},
              "seconds": time.monotonic() - start, "rows": rows}
    (args.out / "lm_study.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "lm_study.md").write_text(markdown(result), encoding="utf-8")
    return result


def markdown(result: dict) -> str:
    s, c = result["settings"], result["corpus"]
    seeds = ", ".join(map(str, s["seeds"]))
    out = [f"### Character-level LM at context {s['context']}: {c['corpus']}", "",
           f"Python {c['python']} text (sha256 {c['sha256'][:12]}...): train {c['symbols']['train']:,}, "
           f"valid {c['symbols']['valid']:,}, test {c['symbols']['test']:,} characters. Every model: "
           f"{s['layers']} layers, d {s['dim']}, FFN {4 * s['dim']}, {s['heads']} heads, dropout {s['dropout']}, "
           f"{s['updates']} updates of {s['max_tokens']:,} tokens (Adam, lr {s['lr']}, {s['warmup']} warm-up, "
           f"inverse-sqrt), seeds {seeds}, {s['threads']} thread(s) each, {s['rounds']} alternating round(s) "
           f"per seed (the order flipped every round and every seed).",
           f"Test bpc: fairseq-eval-lm in non-overlapping blocks of {s['context']}, mean ± sample sd over the "
           f"seeds, at equal updates ({s['updates']}) and at equal time (the last checkpoint, kept every "
           f"{s['checkpoint_interval']} updates, within the updates the model makes in the transformer's time "
           f"for {s['updates']}, at the speed ratio measured in that seed's rounds; at most "
           f"{s['max_time_factor']:g}x). Speed: fairseq's training tokens/s (median over a round's progress "
           f"lines); the ratio is taken per round, then the median. 1-minute load average during training "
           f"{result['load']['mean']:.1f} (max {result['load']['max']:.1f}) on {result['cores']} cores; the "
           f"whole run took {result['seconds'] / 60:.1f} min.", "",
           f"| model | parameters | test bpc, {s['updates']} updates | equal time: updates (per seed) | "
           "test bpc, equal time | train tokens/s | speed vs transformer_lm (per round) |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        per_round = ", ".join(f"{x:.2f}" for x in r["speed_vs_baseline_per_round"])
        et = r["equal_time"]
        out.append(f"| {r['model']} | {r['params']:,} | {r['bpc']:.3f} ± {r['bpc_sd']:.3f} | "
                   f"{', '.join(map(str, et['updates']))} | {_bpc(et['bpc']['mean'])} ± {_bpc(et['bpc']['sd'])} | "
                   f"{r['tokens_per_second']:.0f} | {r['speed_vs_baseline']:.2f}x ({per_round}) |")
    return "\n".join(out) + "\n"


def _seeds(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers, e.g. 1,2,3") from None


def parser(defaults: Dict[str, object] = None) -> argparse.ArgumentParser:
    p = command_parser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("results") / "lm_study",
                   help="folder of the data, runs and results (default: %(default)s)")
    p.add_argument("--context", type=int, default=2048, help="characters per training sequence and test block")
    p.add_argument("--updates", type=int, default=360,
                   help="training updates per model, over all rounds (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds the updates are split into")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per update")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default: %(default)s)")
    p.add_argument("--dim", type=int, default=128, help="embedding dimension (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout (default: %(default)s)")
    p.add_argument("--models", type=lambda v: v.split(","), default=list(ALL_MODELS),
                   help=f"comma-separated LMs trained beside transformer_lm (default: all: {','.join(ALL_MODELS)})")
    p.add_argument("--k", type=int, default=4, help="BPT's k")
    p.add_argument("--window", type=int, default=64, help="window_lm's --attention-window (default: %(default)s)")
    p.add_argument("--stride", type=int, default=128, help="sparse_lm's --sparse-stride (default: %(default)s)")
    p.add_argument("--backend", default="auto", help="the graph models' --graph-attention-backend")
    p.add_argument("--lr", type=float, default=0.002,
                   help="peak learning rate, inverse-sqrt schedule (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="warm-up updates (default: %(default)s)")
    p.add_argument("--heldout-chars", type=int, default=20480, help="characters in valid, and in test")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 2),
                   help="CPU threads per fairseq process (default: $OMP_NUM_THREADS, else 2)")
    p.add_argument("--seeds", type=_seeds, default=[1, 2, 3],
                   help="comma-separated random seeds, one full run of every model each (default: 1,2,3)")
    p.add_argument("--checkpoint-interval", type=int,
                   help="updates between the checkpoints kept for the equal-time scores (default: a 20th of "
                        "--updates, at least 1)")
    p.add_argument("--max-time-factor", type=float, default=3.0,
                   help="a faster model trains at most this many times --updates for its equal-time score "
                        "(default: %(default)s)")
    p.add_argument("--log-interval", type=int, default=5,
                   help="updates between fairseq-train's progress lines (default: %(default)s)")
    p.set_defaults(**(defaults or {}))
    return p


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    result = run_study(args)
    print("\n" + markdown(result), flush=True)
    return result


if __name__ == "__main__":
    main()
