"""A character-level language model on real English text: ``bpt_lm`` against ``transformer_lm`` of
the same size at a long context, on CPU, with nothing to download.

    python -m fairseq_plugins.recipes.lm_study --out results/lm_study   # 4 min on a quiet 2-core CPU
    fairseq-plugins-demo --lm                                            # a smaller run, beside the demo

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

Both models train with ``fairseq-train`` for the same ``--updates`` on the same batches
(``--tokens-per-sample`` characters per sequence, ``--max-tokens`` per update), in ``--rounds``
rounds that alternate the models (each round resumes from ``checkpoint_last.pt``; the order
flips every round), so that other jobs on a shared machine slow both alike. Training speed is
the median of fairseq's ``wps`` (tokens per second) over a round's progress lines; the ratio
BPT / transformer is taken per round, and the median of those ratios is reported with the
1-minute load average seen in each round. Held-out bpc: ``fairseq-eval-lm`` on the test split
in non-overlapping blocks of the training context.
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
    """The two models: the same sizes, both pre-norm (``transformer_lm_matched``); BPT with its
    relative positions only."""
    size = ["--decoder-layers", str(args.layers), "--decoder-embed-dim", str(args.dim),
            "--decoder-ffn-embed-dim", str(4 * args.dim), "--decoder-attention-heads", str(args.heads),
            "--dropout", str(args.dropout)]
    return {BASELINE: ["--arch", "transformer_lm_matched", *size],
            f"bpt_lm k{args.k}": ["--arch", "bpt_lm", *size, "--graph-k", str(args.k),
                                  "--graph-attention-backend", args.backend]}


def _exe(name: str) -> str:
    return Tools()(name)


def train_round(data: Path, save_dir: Path, flags: List[str], args, until: int) -> dict:
    """fairseq-train up to ``until`` updates, resuming from ``save_dir/checkpoint_last.pt``."""
    cmd = [_exe("fairseq-train"), str(data), "--user-dir", str(USER_DIR), "--task", "language_modeling", *flags,
           "--tokens-per-sample", str(args.context), "--sample-break-mode", "none",
           "--max-tokens", str(args.max_tokens), "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
           "--lr", str(args.lr), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(args.warmup),
           "--clip-norm", "1.0", "--max-update", str(until), "--disable-validation", "--no-epoch-checkpoints",
           "--save-dir", str(save_dir), "--seed", str(args.seed), "--num-workers", "0",
           "--log-format", "simple", "--log-interval", str(args.log_interval), "--cpu"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
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
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
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


def run_study(args, say=print) -> dict:
    data = prepare_corpus(args.out / "data-bin", args.heldout_chars)
    models = model_flags(args)
    if args.out.joinpath("runs").exists():  # fairseq would resume from an earlier study's checkpoints
        shutil.rmtree(args.out / "runs")
    rounds: Dict[str, List[dict]] = {name: [] for name in models}
    start = time.monotonic()
    for r, until in enumerate(round_targets(args.updates, args.rounds)):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for name in order:
            rounds[name].append(train_round(data, args.out / "runs" / name.replace(" ", "_"), models[name], args,
                                            until))
            say(f"[lm] round {r + 1}/{args.rounds} {name}: {until} updates, "
                f"{rounds[name][-1]['tokens_per_second']:.0f} tokens/s, load {rounds[name][-1]['load']:.1f}")
    rows = []
    for name in models:
        scores = evaluate(data, args.out / "runs" / name.replace(" ", "_") / "checkpoint_last.pt", args)
        say(f"[lm] {name}: test bpc {scores['bpc']:.3f}")
        rows.append({"model": name, "params": rounds[name][0]["params"], "updates": args.updates,
                     "tokens_per_second": statistics.median(x["tokens_per_second"] for x in rounds[name]),
                     **scores, "rounds": rounds[name]})
    base = rounds[BASELINE]
    for row in rows:
        ratios = [x["tokens_per_second"] / b["tokens_per_second"] for x, b in zip(row["rounds"], base)]
        row["speed_vs_baseline"] = statistics.median(ratios)
        row["speed_vs_baseline_per_round"] = ratios
    loads = [x["load"] for rs in rounds.values() for x in rs]
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
    out = [f"### Character-level LM at context {s['context']}: {c['corpus']}", "",
           f"Python {c['python']} text (sha256 {c['sha256'][:12]}...): train {c['symbols']['train']:,}, "
           f"valid {c['symbols']['valid']:,}, test {c['symbols']['test']:,} characters. Both models: "
           f"{s['layers']} layers, d {s['dim']}, FFN {4 * s['dim']}, {s['heads']} heads, dropout {s['dropout']}, "
           f"{s['updates']} updates of {s['max_tokens']:,} tokens (Adam, lr {s['lr']}, {s['warmup']} warm-up), "
           f"seed {s['seed']}, {s['threads']} thread(s) each, {s['rounds']} alternating rounds.",
           f"Test bpc: fairseq-eval-lm in non-overlapping blocks of {s['context']}. Speed: median over rounds "
           f"of fairseq's training tokens/s; the ratio is taken per round, then the median. 1-minute load "
           f"average during training {result['load']['mean']:.1f} (max {result['load']['max']:.1f}) on "
           f"{result['cores']} cores; the whole run took {result['seconds'] / 60:.1f} min.", "",
           "| model | parameters | test bpc | train tokens/s | speed vs transformer_lm (per round) |",
           "|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        per_round = ", ".join(f"{x:.2f}" for x in r["speed_vs_baseline_per_round"])
        out.append(f"| {r['model']} | {r['params']:,} | {r['bpc']:.3f} | {r['tokens_per_second']:.0f} | "
                   f"{r['speed_vs_baseline']:.2f}x ({per_round}) |")
    return "\n".join(out) + "\n"


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
    p.add_argument("--k", type=int, default=4, help="BPT's k")
    p.add_argument("--backend", default="auto", help="BPT's --graph-attention-backend")
    p.add_argument("--lr", type=float, default=0.002,
                   help="peak learning rate, inverse-sqrt schedule (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="warm-up updates (default: %(default)s)")
    p.add_argument("--heldout-chars", type=int, default=20480, help="characters in valid, and in test")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 2),
                   help="CPU threads per fairseq process (default: $OMP_NUM_THREADS, else 2)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default: %(default)s)")
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
