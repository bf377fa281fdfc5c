"""The demo: every architecture, small, on Multi30K En-De, in about 15 minutes on a CPU.

    python -m scripts.demo                        # ~15 min budget on CPU
    python -m scripts.demo --minutes 60 --gpu     # longer, on a GPU
    python -m scripts.demo --raw-dir ../shared/data/multi30k   # a local copy, no download

Prepares Multi30K (downloads the raw files, or uses ``--raw-dir``; the sibling
``../shared/data/multi30k`` is used when present), trains each architecture of
``configs/demo.yaml`` for the same wall-clock share of the budget (fairseq-train
``--stop-time-hours``), translates the test set (test_2016_flickr) and prints a table
of SacreBLEU, parameters and training speed. The table (Markdown) and a plot (PNG) go
to ``--out`` (default results/demo).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from .config import REPO, USER_DIR, to_flags
from .data.common import DEFAULT_CACHE, prepare
from .data.multi30k import multi30k_en_de
from .evaluate import generate, score

LOCAL_MULTI30K = REPO.parent / "shared" / "data" / "multi30k"
# Each architecture gets an equal share of the time left. Training gets that share minus the
# start-up/validation/translation time the previous architecture needed (first: 80% of it).
TRAIN_SHARE = 0.8
MIN_TRAIN_SECONDS = 5.0


def run_name(entry: dict) -> str:
    """A run folder per table row: rows may share an arch (e.g. an ablation of one model)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", entry["name"]).strip("_").lower()


def load_demo_config(path: Path) -> dict:
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    for key in ("bpe_merges", "model", "train", "generate", "architectures"):
        if key not in cfg:
            raise ValueError(f"{path}: missing '{key}'")
    for entry in cfg["architectures"]:
        if not {"name", "arch"} <= set(entry):
            raise ValueError(f"{path}: every architecture needs a name and an arch, got {entry}")
    return cfg


def prepare_multi30k(raw_dir: Optional[Path], out: Path, bpe_merges: int,
                     limit: Optional[int] = None, test_limit: Optional[int] = None) -> Path:
    if (out / "prep.json").exists():
        print(f"data: reusing {out}", flush=True)
        return out
    splits, recipe = multi30k_en_de(raw_dir, DEFAULT_CACHE)
    if limit:
        splits = {name: s.select(range(min(limit, len(s.src)))) for name, s in splits.items()}
    if test_limit:
        splits["test"] = splits["test"].select(range(min(test_limit, len(splits["test"].src))))
        splits["valid"] = splits["valid"].select(range(min(test_limit, len(splits["valid"].src))))
    recipe.bpe_merges = bpe_merges
    return prepare("multi30k-en-de", splits, recipe, out, workers=1)


_PARAMS_RE = re.compile(r"num\. (?:shared )?model params: ([\d,]+)")
_INNER_RE = re.compile(r"\| train_inner \|.*\bwps=([\d.]+).*\bnum_updates=(\d+)")
_EPOCH_RE = re.compile(r"\| train \|.*\| wps ([\d.]+) .*\| num_updates (\d+)")


def parse_train_log(log: str) -> Dict[str, float]:
    """Parameters, updates and training target words per second from a fairseq-train log:
    the mean over the progress lines (``train_inner``), or over the epoch summaries when
    training stopped before the first progress line. Validation speed is not counted."""
    params = _PARAMS_RE.search(log)
    if params is None:
        raise ValueError("no 'num. model params' line in the fairseq-train log")
    inner, epochs = _INNER_RE.findall(log), _EPOCH_RE.findall(log)
    if not inner and not epochs:
        raise ValueError("no training progress ('wps', 'num_updates') in the fairseq-train log")
    speeds = [float(w) for w, _ in inner or epochs]
    return {"params": int(params.group(1).replace(",", "")),
            "updates": max(int(u) for _, u in inner + epochs),
            "words_per_second": sum(speeds) / len(speeds)}


def train_one(entry: dict, cfg: dict, data: Path, save_dir: Path, seconds: float, gpu: bool,
              log_interval: int) -> Dict[str, float]:
    exe = shutil.which("fairseq-train")
    if exe is None:
        raise RuntimeError("fairseq-train not found on PATH: run scripts/setup.sh")
    cmd = [exe, str(data), "--user-dir", str(USER_DIR), "--arch", entry["arch"],
           *to_flags({**cfg["model"], **entry.get("model", {})}), *to_flags(cfg["train"]),
           "--save-dir", str(save_dir), "--stop-time-hours", f"{seconds / 3600:.6f}",
           "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", str(log_interval),
           "--num-workers", "0", "--seed", "1", *([] if gpu else ["--cpu"])]
    if save_dir.exists():  # fairseq would resume from a previous demo's checkpoint_last.pt
        shutil.rmtree(save_dir)
    save_dir.mkdir(parents=True)
    log_path = save_dir / "train.log"
    print(f"  training for {seconds:.0f} s; log: {log_path}", flush=True)
    lines: List[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line)
            m = _INNER_RE.search(line) or _EPOCH_RE.search(line)
            if m:
                loss = re.search(r"\bloss[= ]([\d.]+)", line)
                print(f"    update {m.group(2)}: loss {loss.group(1) if loss else '?'}, "
                      f"{float(m.group(1)):.0f} words/s", flush=True)
    log = "".join(lines)
    log_path.write_text(log, encoding="utf-8")
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-train failed for {entry['arch']}:\n{log[-4000:]}")
    return parse_train_log(log)


def markdown(rows: List[dict], minutes: float, device: str) -> str:
    out = [f"### Demo: Multi30K En-De test_2016_flickr, {minutes:g} min budget on {device}", "",
           "| Model | arch | SacreBLEU | tok. BLEU | parameters | updates | train words/s |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['name']} | `{r['arch']}` | {r['sacrebleu']:.2f} | {r['tokenized']:.2f} | "
                   f"{r['params']:,} | {r['updates']} | {r['words_per_second']:.0f} |")
    if rows:
        out += ["", f"sacrebleu signature: `{rows[0]['sacrebleu_signature']}`"]
    return "\n".join(out) + "\n"


def plot(rows: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.6 * len(rows) + 1.8))
    axes[0].barh(names, [r["sacrebleu"] for r in rows], color="tab:blue")
    axes[0].set_xlabel("SacreBLEU (test_2016_flickr)")
    axes[1].barh(names, [r["words_per_second"] for r in rows], color="tab:orange")
    axes[1].set_xlabel("training speed (target words / s)")
    axes[1].set_yticklabels([])
    for ax in axes:
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> List[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=15.0, help="total wall-clock budget")
    p.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    p.add_argument("--raw-dir", type=Path, help="local Multi30K raw files (default: "
                   "../shared/data/multi30k when present, else download)")
    p.add_argument("--out", type=Path, default=REPO / "results" / "demo")
    p.add_argument("--archs", help="comma-separated subset of the config's arch names")
    p.add_argument("--gpu", action="store_true", help="train and translate on the GPU")
    p.add_argument("--train-sentences", type=int, help="use only the first N pairs of every split")
    p.add_argument("--test-sentences", type=int, help="use only the first N valid/test pairs")
    p.add_argument("--log-interval", type=int, default=50)
    args = p.parse_args(argv)
    if args.minutes <= 0:
        p.error("--minutes must be positive")
    cfg = load_demo_config(args.config)
    entries = cfg["architectures"]
    if args.archs:
        wanted = args.archs.split(",")
        unknown = set(wanted) - {e["arch"] for e in entries}
        if unknown:
            p.error(f"--archs {sorted(unknown)} not in {args.config}")
        entries = [e for e in entries if e["arch"] in wanted]
    raw_dir = args.raw_dir or (LOCAL_MULTI30K if LOCAL_MULTI30K.is_dir() else None)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    print(f"[demo] preparing Multi30K En-De ({'from ' + str(raw_dir) if raw_dir else 'download'})", flush=True)
    data = prepare_multi30k(raw_dir, args.out / "data-bin", cfg["bpe_merges"],
                            args.train_sentences, args.test_sentences)
    deadline = start + args.minutes * 60
    overhead = 0.0  # start-up, validation and translation time of the previous architecture
    rows = []
    for i, entry in enumerate(entries, 1):
        print(f"[demo {i}/{len(entries)}] {entry['name']} ({entry['arch']}); "
              f"{(time.time() - start) / 60:.1f} of {args.minutes:g} min used", flush=True)
        share = (deadline - time.time()) / (len(entries) - i + 1)
        train_seconds = max(MIN_TRAIN_SECONDS, share - overhead if overhead else TRAIN_SHARE * share)
        run = args.out / "runs" / run_name(entry)
        t_arch = time.time()
        stats = train_one(entry, cfg, data, run, train_seconds, args.gpu, args.log_interval)
        print("  translating the test set", flush=True)
        gen_cfg = {"task": {}, "generate": cfg["generate"]}
        t0 = time.time()
        out = generate(gen_cfg, data, run / "checkpoint_best.pt", "test", cpu=not args.gpu)
        result = {"name": entry["name"], "arch": entry["arch"], **stats,
                  "translate_seconds": time.time() - t0, **score(out, data, "test", run)}
        print(f"  SacreBLEU {result['sacrebleu']:.2f}, {result['params']:,} parameters, "
              f"{result['words_per_second']:.0f} words/s", flush=True)
        rows.append(result)
        overhead = max(0.0, time.time() - t_arch - train_seconds)
    device = "GPU" if args.gpu else f"CPU ({os.cpu_count()} cores)"
    table = markdown(rows, args.minutes, device)
    (args.out / "demo.md").write_text(table, encoding="utf-8")
    (args.out / "demo.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, args.out / "demo.png")
    print("\n" + table + f"\nsaved {args.out / 'demo.md'} and {args.out / 'demo.png'} "
          f"({(time.time() - start) / 60:.1f} min)", flush=True)
    return rows


if __name__ == "__main__":
    main()
