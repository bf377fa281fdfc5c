"""Quality study: every model and its fair baselines on Multi30K En-De, same size, same
number of updates, several seeds.

    python -m scripts.quality_study                          # configs/quality_study.yaml, all rows
    python -m scripts.quality_study --models transformer_postnorm,slowfast_slow_only --seeds 1,2,3
    python -m scripts.quality_study --models slowfast_slow_only --updates 400,1200   # train on
    python -m scripts.quality_study --tiny --out /tmp/qs     # seconds: the test suite's run
    python -m scripts.quality_study --record benchmarks/quality_study.json --label "..." --machine "..."

Each (model, seed) trains with fairseq-train (``fairseq_plugins.recipes.train``) to every checkpoint of
``updates`` in turn, resuming in the same folder, and each checkpoint is translated and
scored (``fairseq_plugins.recipes.evaluate``: detokenized SacreBLEU on test_2016_flickr). A finished step
is never redone, so an interrupted study continues where it stopped. The report gives,
per model and checkpoint, the mean and sample standard deviation of SacreBLEU over the
seeds, the validation loss, the parameters and the time per update relative to the
``baseline`` entry trained with the same seed (ratios of runs taken at different times:
on a shared machine they are good to about +-20%; the benchmark scripts measure speed
properly). ``--parallel`` runs train side by side, each with ``--threads`` threads.
"""

import argparse
import json
import math
import os
import re
import statistics
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import yaml
from tqdm import tqdm

from fairseq_plugins.command_line import import_extra
from fairseq_plugins.recipes.config import CONFIG_DIR
from fairseq_plugins.recipes.demo import prepare_multi30k, select_entries
from fairseq_plugins.recipes.evaluate import generate, score
from fairseq_plugins.recipes.train import build_command

_KEYS = ("bpe_merges", "seeds", "updates", "baseline", "model", "train", "generate", "models")
# --tiny: a 300-pair corpus, models 32 wide (fast branch 8), a few updates; every step in seconds
TINY = {"train_sentences": 300, "test_sentences": 20, "bpe_merges": 300, "seeds": [1, 2], "updates": [2, 4],
        "model": {"encoder-layers": 1, "decoder-layers": 1, "encoder-embed-dim": 32, "decoder-embed-dim": 32,
                  "encoder-ffn-embed-dim": 64, "decoder-ffn-embed-dim": 64, "encoder-attention-heads": 2,
                  "decoder-attention-heads": 2, "fast-embed-dim": 8, "fast-ffn-embed-dim": 16,
                  "fast-attention-heads": 2}}


def load_study(path: Path) -> dict:
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    missing = [k for k in _KEYS if k not in (cfg or {})]
    if missing:
        raise ValueError(f"{path}: missing {missing}")
    keys = [m.get("key") for m in cfg["models"]]
    if any(not {"key", "name", "arch", "group"} <= set(m) for m in cfg["models"]) or len(set(keys)) != len(keys):
        raise ValueError(f"{path}: every model needs a unique key, a name, an arch and a group")
    if cfg["baseline"] not in keys:
        raise ValueError(f"{path}: baseline {cfg['baseline']!r} is not a model key")
    for c in cfg.get("comparisons", []):
        if not {"key", "reference", "isolates"} <= set(c) or not {c["key"], c["reference"]} <= set(keys):
            raise ValueError(f"{path}: comparison {c} needs a key and a reference among the model keys, "
                             "and what it isolates")
    if list(cfg["updates"]) != sorted(set(cfg["updates"])) or cfg["updates"][0] < 1:
        raise ValueError(f"{path}: updates must be increasing positive numbers")
    return cfg


_PARAMS_RE = re.compile(r"num\. (?:shared )?model params: ([\d,]+)")
_INNER_RE = re.compile(r"\| train_inner \|.*\bnum_updates=(\d+).*\btrain_wall=([\d.]+)")
_VALID_RE = re.compile(r"\| valid \|.*\| loss ([\d.]+) .*\| num_updates (\d+)")


def parse_train_log(log: str, updates: int) -> Dict[str, Optional[float]]:
    """Parameters, seconds per update and validation loss at ``updates`` from a
    fairseq-train log (several resumed sessions appended). The time is the mean over the
    progress intervals up to ``updates`` but the first of each session (start-up)."""
    params = _PARAMS_RE.search(log)
    if params is None:
        raise ValueError("no 'num. model params' line in the fairseq-train log")
    seconds, steps, previous = 0.0, 0, None
    for session in log.split("fairseq_cli.train | {")[1:] or [log]:
        for update, wall in ((int(u), float(w)) for u, w in _INNER_RE.findall(session)):
            if update > updates:
                break
            if previous is not None and update > previous:
                seconds, steps = seconds + wall, steps + update - previous
            previous = update
        previous = None
    valid = [float(loss) for loss, u in _VALID_RE.findall(log) if int(u) == updates]
    return {"params": int(params.group(1).replace(",", "")),
            "seconds_per_update": seconds / steps if steps else None,
            "valid_loss": valid[-1] if valid else None}


def train_to(entry: dict, cfg: dict, data: Path, run_dir: Path, seed: int, updates: int) -> None:
    """Train (resuming from the folder's checkpoint_last.pt) until ``updates``; the
    checkpoint is kept as checkpoint_<updates>.pt. The log is appended to train.log."""
    train_cfg = {"arch": entry["arch"], "task": {}, "gpus": 1,
                 "model": {**cfg["model"], **entry.get("model", {})},
                 "train": {**cfg["train"], "max-update": updates}}
    cmd = build_command(train_cfg, data, run_dir, gpus_per_node=0, extra=[
        "--seed", str(seed), "--no-epoch-checkpoints", "--log-format", "simple",
        "--log-interval", str(cfg.get("log_interval", 25)), "--num-workers", "0"])
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "train.log", "a", encoding="utf-8") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise RuntimeError(f"fairseq-train failed: see {run_dir / 'train.log'}")
    shutil.copyfile(run_dir / "checkpoint_last.pt", run_dir / f"checkpoint_{updates}.pt")


def run_one(entry: dict, seed: int, cfg: dict, data: Path, out: Path) -> List[dict]:
    """Every checkpoint of one (model, seed): trained, translated and scored once."""
    run_dir = out / "runs" / entry["key"] / f"seed{seed}"
    results = []
    for updates in cfg["updates"]:
        result_path = run_dir / f"result-{updates}.json"
        if result_path.exists():
            results.append(json.loads(result_path.read_text()))
            continue
        checkpoint = run_dir / f"checkpoint_{updates}.pt"
        if not checkpoint.exists():
            train_to(entry, cfg, data, run_dir, seed, updates)
        hyp_file = run_dir / f"generate-test-{updates}.txt"
        t0 = time.time()
        if hyp_file.exists():  # translated earlier; score() refuses an incomplete file
            translations = hyp_file.read_text(encoding="utf-8")
        else:
            translations = generate({"task": {}, "generate": cfg["generate"]}, data, checkpoint, "test", cpu=True)
            hyp_file.write_text(translations, encoding="utf-8")
        result = {"key": entry["key"], "name": entry["name"], "group": entry["group"], "arch": entry["arch"],
                  "seed": seed, "updates": updates, "translate_seconds": time.time() - t0,
                  **parse_train_log((run_dir / "train.log").read_text(encoding="utf-8"), updates),
                  **score(translations, data, "test", run_dir / f"scored-{updates}")}
        result_path.write_text(json.dumps(result, indent=2) + "\n")
        results.append(result)
    return results


def _spread(values: Sequence[float]) -> Dict[str, Optional[float]]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values), "n": len(values)}


def summarize(results: List[dict], baseline: str) -> List[dict]:
    """One row per (model, checkpoint): BLEU and validation loss over the seeds, and the
    time per update over the baseline's with the same seed and checkpoint (median)."""
    speed = {(r["key"], r["seed"], r["updates"]): r["seconds_per_update"] for r in results}
    rows = []
    for key, updates in dict.fromkeys((r["key"], r["updates"]) for r in results):
        runs = sorted((r for r in results if r["key"] == key and r["updates"] == updates), key=lambda r: r["seed"])
        ratios = [r["seconds_per_update"] / speed[(baseline, r["seed"], updates)] for r in runs
                  if r["seconds_per_update"] and speed.get((baseline, r["seed"], updates))]
        losses = [r["valid_loss"] for r in runs if r["valid_loss"] is not None]
        rows.append({"key": key, "name": runs[0]["name"], "group": runs[0]["group"], "arch": runs[0]["arch"],
                     "updates": updates, "params": runs[0]["params"], "seeds": [r["seed"] for r in runs],
                     "sacrebleu": _spread([r["sacrebleu"] for r in runs]),
                     "scores": [r["sacrebleu"] for r in runs],
                     "valid_loss": _spread(losses) if losses else None,
                     "time_ratio": statistics.median(ratios) if ratios else None,
                     "time_ratio_range": (min(ratios), max(ratios)) if ratios else None,
                     "signature": runs[0]["sacrebleu_signature"]})
    return rows


def difference(rows: List[dict], key: str, reference: str, updates: int,
               measure: str = "sacrebleu") -> Optional[dict]:
    """Mean ``measure`` (``sacrebleu`` or ``valid_loss``) of ``key`` minus ``reference`` at
    ``updates``, with the standard error of the difference of two means (independent seeds);
    None when either has < 2 seeds."""
    pick = {r["key"]: r for r in rows if r["updates"] == updates}
    if key not in pick or reference not in pick:
        return None
    a, b = pick[key][measure], pick[reference][measure]
    if a is None or b is None or a["std"] is None or b["std"] is None:
        return None
    return {"diff": a["mean"] - b["mean"], "se": math.sqrt(a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"])}


def comparison_records(rows: List[dict], cfg: dict) -> List[dict]:
    """The config's ``comparisons`` (what each pair of rows isolates): differences of means at
    every checkpoint both rows reached."""
    out = []
    for c in cfg.get("comparisons", []):
        for updates in sorted({r["updates"] for r in rows}):
            bleu = difference(rows, c["key"], c["reference"], updates)
            if bleu is not None:
                out.append({"key": c["key"], "reference": c["reference"], "isolates": c["isolates"],
                            "updates": updates, "sacrebleu": bleu,
                            "valid_loss": difference(rows, c["key"], c["reference"], updates, "valid_loss")})
    return out


def comparisons(rows: List[dict], cfg: dict) -> List[str]:
    """``comparison_records`` as a markdown table."""
    out = []
    for c in comparison_records(rows, cfg):
        bleu, loss = c["sacrebleu"], c["valid_loss"]
        loss_text = "-" if loss is None else f"{loss['diff']:+.3f} ± {loss['se']:.3f}"
        out.append(f"| {c['key']} - {c['reference']} | {c['isolates']} | {c['updates']} | "
                   f"{bleu['diff']:+.2f} ± {bleu['se']:.2f} | {loss_text} |")
    if not out:
        return []
    return ["", "Differences of means (± standard error of the difference, independent seeds):", "",
            "| comparison | what it isolates | updates | SacreBLEU | valid loss |",
            "|---|---|---:|---:|---:|", *out]


def _pm(spread: Optional[dict], digits: int = 2) -> str:
    if spread is None:
        return "-"
    std = f" ± {spread['std']:.{digits}f}" if spread["std"] is not None else ""
    return f"{spread['mean']:.{digits}f}{std}"


def markdown(rows: List[dict], cfg: dict) -> str:
    out = ["| Model | updates | SacreBLEU (mean ± std) | seeds: scores | valid loss | parameters | "
           "time / update vs baseline |", "|---|---:|---:|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["updates"], r["group"] != "baselines", r["group"])):
        ratio = "-" if r["time_ratio"] is None else (
            f"{r['time_ratio']:.2f} ({r['time_ratio_range'][0]:.2f}-{r['time_ratio_range'][1]:.2f})")
        scores = ", ".join(f"{s:.2f}" for s in r["scores"])
        out.append(f"| {r['name']} | {r['updates']} | {_pm(r['sacrebleu'])} | {r['seeds']}: {scores} | "
                   f"{_pm(r['valid_loss'], 3)} | {r['params']:,} | {ratio} |")
    out += comparisons(rows, cfg)
    if rows:
        out += ["", f"baseline of the time ratio: `{cfg['baseline']}` (same seed, same checkpoint); "
                    f"sacrebleu signature: `{rows[0]['signature']}`"]
    return "\n".join(out) + "\n"


def plot(rows: List[dict], path: Path) -> None:
    matplotlib = import_extra("matplotlib", "plots", "the quality study's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    checkpoints = sorted({r["updates"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) * len(checkpoints) + 1.5))
    height = 0.8 / len(checkpoints)
    for i, updates in enumerate(checkpoints):
        by_name = {r["name"]: r for r in rows if r["updates"] == updates}
        ys = [j + i * height for j, n in enumerate(names) if n in by_name]
        picked = [by_name[n] for n in names if n in by_name]
        ax.barh(ys, [r["sacrebleu"]["mean"] for r in picked], height,
                xerr=[r["sacrebleu"]["std"] or 0 for r in picked], label=f"{updates} updates", capsize=3)
        for y, r in zip(ys, picked):
            ax.plot(r["scores"], [y] * len(r["scores"]), "k.", markersize=4)
    ax.set_yticks([j + height * (len(checkpoints) - 1) / 2 for j in range(len(names))], names)
    ax.invert_yaxis()
    ax.set_xlabel("SacreBLEU, test_2016_flickr (bar: mean, line: std, dots: seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def record(path: Path, label: str, machine: str, rows: List[dict], cfg: dict, command: str) -> None:
    """Add this study's rows and comparisons to the committed results file ``path``
    (``benchmarks/quality_study.json``, what ``scripts/readme_results.py`` renders), as a new
    run after the earlier ones; a run with the same label is replaced."""
    runs = json.loads(path.read_text(encoding="utf-8"))["runs"] if path.exists() else []
    entry = {"label": label, "date": time.strftime("%Y-%m-%d"), "machine": machine, "commands": [command],
             "rows": rows, "comparisons": comparison_records(rows, cfg)}
    runs = [r for r in runs if r["label"] != label] + [entry]
    path.write_text(json.dumps({"runs": runs}, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv=None) -> List[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=CONFIG_DIR / "quality_study.yaml")
    p.add_argument("--out", type=Path, default=Path("results") / "quality_study")
    p.add_argument("--raw-dir", type=Path, help="local Multi30K raw files (default: download once into the cache)")
    p.add_argument("--models", help="comma-separated model keys of the config (default: all)")
    p.add_argument("--seeds", help="comma-separated seeds (default: the config's)")
    p.add_argument("--updates", help="comma-separated checkpoints, in updates (default: the config's)")
    p.add_argument("--parallel", type=int, default=2, help="runs trained side by side")
    p.add_argument("--threads", type=int, default=1, help="threads of each run")
    p.add_argument("--tiny", action="store_true", help="300 pairs, a 32-wide model, 2 and 4 updates, 2 seeds")
    p.add_argument("--record", type=Path, metavar="JSON",
                   help="also add the results to this committed file (benchmarks/quality_study.json) as a run "
                        "named --label on --machine")
    p.add_argument("--label", help="the run's name in --record (e.g. 'AMD EPYC, C++ CPU kernel')")
    p.add_argument("--machine", help="the machine in words, for --record (CPU, cores, load, threads per run)")
    args = p.parse_args(argv)
    if args.record and not (args.label and args.machine):
        p.error("--record needs --label and --machine")
    cfg = load_study(args.config)
    limits = {}
    if args.tiny:
        cfg.update(bpe_merges=TINY["bpe_merges"], seeds=TINY["seeds"], updates=TINY["updates"], log_interval=1)
        for options in [cfg["model"]] + [e.get("model", {}) for e in cfg["models"]]:
            options.update({k: v for k, v in TINY["model"].items() if k in options})  # the sizes each one sets
        limits = {"limit": TINY["train_sentences"], "test_limit": TINY["test_sentences"]}
    entries = select_entries(cfg["models"], args.models, "key", "--models", p, args.config)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else cfg["seeds"]
    if args.updates:
        cfg["updates"] = [int(u) for u in args.updates.split(",")]
        if cfg["updates"] != sorted(set(cfg["updates"])) or cfg["updates"][0] < 1:
            p.error("--updates must be increasing positive numbers")
    raw_dir = args.raw_dir if args.raw_dir.is_dir() else None
    data = prepare_multi30k(raw_dir, args.out / "data-bin", cfg["bpe_merges"], **limits)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)  # the runs inherit it
    jobs = [(e, s) for s in seeds for e in entries]  # seed-major: every model gets seed 1 first
    done: Dict[int, List[dict]] = {}
    with ThreadPoolExecutor(max(1, args.parallel)) as pool, tqdm(total=len(jobs), desc="runs", unit="run") as bar:
        futures = {pool.submit(run_one, e, s, cfg, data, args.out): i for i, (e, s) in enumerate(jobs)}
        for future in as_completed(futures):
            done[futures[future]] = future.result()
            bar.update()
    results = [r for i in sorted(done) for r in done[i]]
    rows = summarize(results, cfg["baseline"])
    table = markdown(rows, cfg)
    (args.out / "quality_study.md").write_text(table, encoding="utf-8")
    (args.out / "quality_study.json").write_text(json.dumps({"rows": rows, "runs": results}, indent=2) + "\n")
    plot(rows, args.out / "quality_study.png")
    if args.record:
        command = " ".join(["python -m scripts.quality_study", *(argv if argv is not None else sys.argv[1:])])
        record(args.record, args.label, args.machine, rows, cfg, command)
    print("\n" + table, flush=True)
    return rows


if __name__ == "__main__":
    main()
