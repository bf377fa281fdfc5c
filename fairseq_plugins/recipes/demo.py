"""The demo: every architecture, small, on Multi30K En-De, the same number of updates each.

    fairseq-plugins-demo                        # about 15 min on a quiet 2-core CPU
    fairseq-plugins-demo --updates 2000 --gpu   # more updates, on a GPU
    fairseq-plugins-demo --minutes 30           # also stop each model at an equal time share
    fairseq-plugins-demo --raw-dir path/to/multi30k   # a local copy, no download
    fairseq-plugins-demo --lm                   # then a character-level BPT LM against transformer_lm

Prepares Multi30K En-De (downloads the raw files once into the cache, or uses ``--raw-dir``),
trains each architecture of
``configs/demo.yaml`` for the config's fixed number of updates with its one seed
(fairseq-train ``--max-update``), translates the test set (test_2016_flickr) and prints a
table of SacreBLEU, parameters, training speed and time per update relative to the
config's baseline (the stock transformer), measured in the same run. Fixed updates make
BLEU the same on a slow or busy machine, which only takes longer. The table (Markdown), a
plot (PNG) and the raw numbers (JSON) go to ``--out`` (default results/demo).

``--lm`` adds, after the translation models, a smaller run of ``lm_study``: a character-level
``bpt_lm`` (k 4) against ``transformer_lm`` of the same size at context 2048 on the English
prose that CPython ships (nothing to download), test bits per character and training speed
(120 updates: 2.3 min more on a quiet 2-core CPU, measured; table in ``--out``/lm).
"""

import contextlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from ..command_line import command_parser, import_extra
from .config import CONFIG_DIR, USER_DIR, to_flags
from .data.common import prepare
from .data.download import DEFAULT_CACHE
from .data.multi30k import multi30k_en_de
from .demo_progress import DemoProgress, clock
from .evaluate import generate, score
from .lm_study import markdown as lm_markdown, parser as lm_parser, run_study
from .tools import Tools
from .train_log import epoch_summaries, model_params, progress

# --lm: lm_study at a smaller scale, BPT against the transformer, one seed (its other settings are
# lm_study's defaults)
DEMO_LM = ["--updates", "120", "--rounds", "3"]
DEMO_LM_DEFAULTS = {"models": ["transformer_lm", "bpt_lm"], "seeds": [1]}
PLOT_FEATURE = "the demo's plot (demo.png)"

# With --minutes, each architecture gets an equal share of the time left. Training gets that
# share minus the start-up/validation/translation time the previous one needed (first: 80%).
TRAIN_SHARE = 0.8
MIN_TRAIN_SECONDS = 5.0
# fairseq-train flags the demo sets itself (from the config's updates/seed and its options)
_SET_BY_DEMO = {"max-update", "stop-time-hours", "seed", "save-dir", "cpu", "log-format", "log-interval",
                "num-workers", "user-dir", "arch"}


def run_name(entry: dict) -> str:
    """A run folder per table row: rows may share an arch (e.g. an ablation of one model)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", entry["name"]).strip("_").lower()


def load_demo_config(path: Path) -> dict:
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    for key in ("bpe_merges", "updates", "seed", "baseline", "model", "train", "generate", "architectures"):
        if key not in cfg:
            raise ValueError(f"{path}: missing '{key}'")
    if not isinstance(cfg["updates"], int) or cfg["updates"] < 1:
        raise ValueError(f"{path}: 'updates' must be a positive integer, got {cfg['updates']!r}")
    clash = _SET_BY_DEMO.intersection(cfg["train"]) | _SET_BY_DEMO.intersection(cfg["model"])
    for entry in cfg["architectures"]:
        if not {"name", "arch"} <= set(entry):
            raise ValueError(f"{path}: every architecture needs a name and an arch, got {entry}")
        clash |= _SET_BY_DEMO.intersection(entry.get("model", {}))
    if clash:
        raise ValueError(f"{path}: {sorted(clash)} are set by the demo (use 'updates' and 'seed')")
    if cfg["baseline"] not in [e["name"] for e in cfg["architectures"]]:
        raise ValueError(f"{path}: baseline {cfg['baseline']!r} is not the name of an architecture")
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


def select_entries(entries: List[dict], wanted: Optional[str], key: str, flag: str, parser, config) -> List[dict]:
    """The config entries whose ``key`` is in the comma-separated ``wanted`` (all when None);
    an unknown name is a usage error naming the flag and the config."""
    if not wanted:
        return entries
    names = wanted.split(",")
    unknown = set(names) - {e[key] for e in entries}
    if unknown:
        parser.error(f"{flag} {sorted(unknown)} not in {config}")
    return [e for e in entries if e[key] in names]


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> Optional[float]:
    """A container's CPU quota in cores (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), or
    None when there is none: os.cpu_count() and torch's default thread count do not see it."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        return quota / int((root / "cpu" / "cpu.cfs_period_us").read_text()) if quota > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may use: its affinity mask, lowered by a container's CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def busy_warnings(load: float, cores: int, threads: int) -> List[str]:
    """Why the speed columns (not BLEU) of this run may be slow or noisy."""
    out = []
    if load > cores:
        out.append(f"the machine is busy: load average {load:.1f} on {cores} cores. The demo will take "
                   "longer and its speed columns will be noisy; with fixed updates (the default) BLEU "
                   "does not change.")
    if threads > cores:
        out.append(f"{threads} threads per fairseq-train on {cores} cores oversubscribe the CPU, which "
                   f"makes training much slower: use --threads {cores} or fewer.")
    return out


def parse_train_log(log: str) -> Dict[str, float]:
    """Parameters, updates and training target words per second from a fairseq-train log:
    the mean over the progress lines (``train_inner``), or over the epoch summaries when
    training stopped before the first progress line. Validation speed is not counted."""
    params = model_params(log)
    inner, epochs = progress(log), epoch_summaries(log)
    if not inner and not epochs:
        raise ValueError("no training progress ('wps', 'num_updates') in the fairseq-train log")
    speeds = [wps for wps, _ in inner or epochs]
    return {"params": params, "updates": max(updates for _, updates in inner + epochs),
            "words_per_second": sum(speeds) / len(speeds)}


class UpdateTimer:
    """Seconds per update from the arrival times of fairseq-train's progress lines: the median
    over the intervals between two ``train_inner`` lines with nothing else in between
    (validation, checkpoint saving and the epoch's end are left out; the median also drops
    the intervals a busy machine slowed down most)."""

    def __init__(self):
        self.intervals: List[float] = []
        self.last = None  # (time, updates) of the previous train_inner line, if uninterrupted

    def line(self, text: str, t: float) -> Optional[int]:
        """Feed one log line; returns the updates done when the line reports them."""
        inner = progress(text)
        if inner:
            updates = inner[-1][1]
            if self.last is not None and updates > self.last[1]:
                self.intervals.append((t - self.last[0]) / (updates - self.last[1]))
            self.last = (t, updates)
            return updates
        if re.search(r"\| (valid|train) \||saved checkpoint|begin training epoch", text):
            self.last = None
        epoch = epoch_summaries(text)
        return epoch[-1][1] if epoch else None

    def seconds_per_update(self) -> Optional[float]:
        return statistics.median(self.intervals) if self.intervals else None


def train_command(entry: dict, cfg: dict, data: Path, save_dir: Path, updates: Optional[int],
                  seconds: Optional[float], gpu: bool, log_interval: int) -> List[str]:
    """fairseq-train for one row: stops after ``updates`` (if any) or ``seconds`` (if any)."""
    return [Tools()("fairseq-train"), str(data), "--user-dir", str(USER_DIR), "--arch", entry["arch"],
            *to_flags({**cfg["model"], **entry.get("model", {})}), *to_flags(cfg["train"]),
            "--seed", str(cfg["seed"]), "--save-dir", str(save_dir), "--no-epoch-checkpoints",
            "--log-format", "simple", "--log-interval", str(log_interval), "--num-workers", "0",
            *(["--max-update", str(updates)] if updates else []),
            *(["--stop-time-hours", f"{seconds / 3600:.6f}"] if seconds else []),
            *([] if gpu else ["--cpu"])]


def train_one(entry: dict, cfg: dict, data: Path, save_dir: Path, updates: Optional[int],
              seconds: Optional[float], gpu: bool, log_interval: int, progress: DemoProgress,
              index: int) -> Dict[str, float]:
    cmd = train_command(entry, cfg, data, save_dir, updates, seconds, gpu, log_interval)
    if save_dir.exists():  # fairseq would resume from a previous demo's checkpoint_last.pt
        shutil.rmtree(save_dir)
    save_dir.mkdir(parents=True)
    log_path = save_dir / "train.log"
    limits = [f"{updates} updates"] if updates else []
    limits += [f"{seconds:.0f} s"] if seconds else []
    progress.write(f"{entry['name']}: training for {' or '.join(limits)}; log: {log_path}")
    lines: List[str] = []
    timer = UpdateTimer()
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # the line times are the speed measurement
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc, \
            open(log_path, "w", encoding="utf-8") as log_file:
        for line in proc.stdout:
            lines.append(line)
            log_file.write(line)
            log_file.flush()
            done = timer.line(line, time.monotonic())
            if done is not None and done != progress.done_updates[index]:
                progress.trained(index, done, timer.seconds_per_update())
    log = "".join(lines)
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-train failed for {entry['arch']}:\n{log[-4000:]}")
    stats = parse_train_log(log)
    if updates and not seconds and stats["updates"] != updates:
        raise RuntimeError(f"{entry['name']}: fairseq-train stopped after {stats['updates']} of {updates} "
                           f"updates (raise max-epoch in the config?); log: {log_path}")
    return {**stats, "seconds_per_update": timer.seconds_per_update()}


@contextlib.contextmanager
def thread_environment(threads: int, passive: bool):
    """Thread counts for the fairseq processes the demo starts (they inherit the environment),
    restored afterwards. ``passive``: waiting OpenMP threads sleep instead of spinning on
    cores that other processes need, which a busy machine punishes."""
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    if passive:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_models(entries: List[dict], cfg: dict, data: Path, out: Path, updates: int, deadline: Optional[float],
               gpu: bool, log_interval: int, progress: DemoProgress):
    """Train and translate every entry in turn; yields each one's table row and the load
    averages seen after its training and its translation."""
    overhead = 0.0  # with a time budget: start-up, validation and translation time of the previous one
    for i, entry in enumerate(entries):
        train_seconds = None
        if deadline is not None:
            share = (deadline - time.monotonic()) / (len(entries) - i)
            train_seconds = max(MIN_TRAIN_SECONDS, share - overhead if overhead else TRAIN_SHARE * share)
        run = out / "runs" / run_name(entry)
        t_arch = time.monotonic()
        progress.set_stage(i, "starting")
        stats = train_one(entry, cfg, data, run, updates, train_seconds, gpu, log_interval, progress, i)
        loads = [os.getloadavg()[0]]
        progress.set_stage(i, "translating")
        t0 = time.monotonic()
        hyps = generate({"task": {}, "generate": cfg["generate"]}, data, run / "checkpoint_best.pt", "test",
                        cpu=not gpu)
        row = {"name": entry["name"], "arch": entry["arch"], **stats,
               "translate_seconds": time.monotonic() - t0, **score(hyps, data, "test", run)}
        loads.append(os.getloadavg()[0])
        progress.finished(i)
        progress.write(f"{entry['name']}: SacreBLEU {row['sacrebleu']:.2f}, {row['params']:,} parameters, "
                       f"{row['updates']} updates, {row['words_per_second']:.0f} words/s")
        if train_seconds is not None:
            overhead = max(0.0, time.monotonic() - t_arch - train_seconds)
        yield row, loads


def relative_times(rows: List[dict], baseline: str) -> None:
    """Each row's time per update over the baseline's, measured in the same run (or None)."""
    base = next((r for r in rows if r["name"] == baseline), None)
    for r in rows:
        ok = base is not None and base["seconds_per_update"] and r["seconds_per_update"]
        r["relative_time"] = r["seconds_per_update"] / base["seconds_per_update"] if ok else None


def markdown(rows: List[dict], run: dict) -> str:
    limit = f"{run['updates']} updates per model" if run["updates"] else "no update limit"
    if run["minutes"]:
        limit += f", {run['minutes']:g} min budget"
    load = run["load"]
    busy = load["mean"] > run["cores"] + 0.5
    out = [f"### Demo: Multi30K En-De test_2016_flickr, {limit} (seed {run['seed']}) on {run['device']}", "",
           f"Speeds measured in this run: {run['threads']} thread(s) per process, 1-min load average "
           f"{load['mean']:.1f} (max {load['max']:.1f}) on {run['cores']} cores"
           + (" — a busy machine, so the speed columns are noisy" if busy else "")
           + (" (and, with a time budget, BLEU)." if busy and run["minutes"] else "."),
           f"Time/update is relative to {run['baseline']} (median over the logging intervals); "
           + (f"the whole demo took {clock(run['seconds'])}." if len(rows) == run["models"] else
            f"{len(rows)} of {run['models']} models done after {clock(run['seconds'])}."), "",
           f"| Model | arch | SacreBLEU | tok. BLEU | parameters | updates | train words/s | "
           f"time/update vs {run['baseline']} |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rel = "–" if r["relative_time"] is None else f"{r['relative_time']:.2f}x"
        out.append(f"| {r['name']} | `{r['arch']}` | {r['sacrebleu']:.2f} | {r['tokenized']:.2f} | "
                   f"{r['params']:,} | {r['updates']} | {r['words_per_second']:.0f} | {rel} |")
    if rows:
        out += ["", f"sacrebleu signature: `{rows[0]['sacrebleu_signature']}`"]
    return "\n".join(out) + "\n"


def plot(rows: List[dict], baseline: str, path: Path) -> None:
    matplotlib = import_extra("matplotlib", "plots", PLOT_FEATURE)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.6 * len(rows) + 1.8))
    axes[0].barh(names, [r["sacrebleu"] for r in rows], color="tab:blue")
    axes[0].set_xlabel("SacreBLEU (test_2016_flickr)")
    axes[1].barh(names, [r["relative_time"] or 0.0 for r in rows], color="tab:orange")
    axes[1].axvline(1.0, color="black", linewidth=0.8)
    axes[1].set_xlabel(f"training time per update (x {baseline}; lower is faster)")
    axes[1].set_yticklabels([])
    for ax in axes:
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(rows: List[dict], run_info: dict, out: Path) -> str:
    """demo.md, demo.json and demo.png of the rows so far; returns the Markdown table."""
    relative_times(rows, run_info["baseline"])
    table = markdown(rows, run_info)
    (out / "demo.md").write_text(table, encoding="utf-8")
    (out / "demo.json").write_text(json.dumps({"run": run_info, "rows": rows}, indent=2) + "\n")
    plot(rows, run_info["baseline"], out / "demo.png")
    return table


def language_model_part(out: Path, threads: int, options: List[str] = DEMO_LM) -> dict:
    """The --lm part: lm_study with ``options`` into ``out``; prints and returns its result."""
    args = lm_parser(DEMO_LM_DEFAULTS).parse_args([*options, "--out", str(out), "--threads", str(threads)])
    print(f"[demo] language model: bpt_lm k{args.k} against transformer_lm at context {args.context}, "
          f"{args.updates} updates each", flush=True)
    result = run_study(args, say=lambda line: print(line, flush=True))
    print("\n" + lm_markdown(result) + f"\nsaved {out / 'lm_study.md'}", flush=True)
    return result


def main(argv=None) -> List[dict]:
    p = command_parser(description=__doc__)
    p.add_argument("--updates", type=int, help="updates per model (default: the config's 'updates'; "
                   "0: no limit, train for the --minutes budget)")
    p.add_argument("--minutes", type=float, help="a wall-clock budget for the whole demo: each model also "
                   "stops at its equal share (makes BLEU depend on the machine's speed)")
    p.add_argument("--config", type=Path, default=CONFIG_DIR / "demo.yaml",
                   help="the models and settings to run (default: configs/demo.yaml)")
    p.add_argument("--raw-dir", type=Path, help="local Multi30K raw files "
                   "(train/val/test_2016_flickr .en/.de, plain or .gz; default: download once into the cache)")
    p.add_argument("--out", type=Path, default=Path("results") / "demo",
                   help="folder of the table, plot, numbers and runs (default: results/demo)")
    p.add_argument("--archs", help="comma-separated subset of the config's arch names")
    p.add_argument("--gpu", action="store_true", help="train and translate on the GPU")
    p.add_argument("--threads", type=int, help="CPU threads per fairseq process (default: "
                   "$OMP_NUM_THREADS, else the usable cores: affinity mask and container CPU quota)")
    p.add_argument("--train-sentences", type=int, help="use only the first N pairs of every split")
    p.add_argument("--test-sentences", type=int, help="use only the first N valid/test pairs")
    p.add_argument("--log-interval", type=int, default=10, help="updates between fairseq-train's "
                   "progress lines (the speed measurement)")
    p.add_argument("--progress-interval", type=float, default=30.0,
                   help="seconds between progress lines when the output is not a terminal")
    p.add_argument("--lm", action="store_true", help="then a character-level language model: bpt_lm "
                   "against transformer_lm at context 2048 (CPU; results in OUT/lm)")
    args = p.parse_args(argv)
    import_extra("matplotlib", "plots", PLOT_FEATURE)  # now, not after the first model's training
    cfg = load_demo_config(args.config)
    updates = cfg["updates"] if args.updates is None else args.updates
    if updates < 0 or (args.minutes is not None and args.minutes <= 0):
        p.error("--updates must be >= 0 and --minutes positive")
    if not updates and not args.minutes:
        p.error("--updates 0 needs a --minutes budget")
    entries = select_entries(cfg["architectures"], args.archs, "arch", "--archs", p, args.config)
    raw_dir = args.raw_dir
    cores = usable_cores()
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or cores)
    if threads < 1:
        p.error("--threads must be positive")
    load0 = os.getloadavg()[0]
    for warning in busy_warnings(load0, cores, threads):
        print(f"[demo] warning: {warning}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + args.minutes * 60 if args.minutes else None
    with thread_environment(threads, passive=load0 > cores):
        print(f"[demo] preparing Multi30K En-De ({'from ' + str(raw_dir) if raw_dir else 'download'})",
              flush=True)
        data = prepare_multi30k(raw_dir, args.out / "data-bin", cfg["bpe_merges"],
                                args.train_sentences, args.test_sentences)
        progress = DemoProgress([e["name"] for e in entries], updates or None, deadline,
                                interval=args.progress_interval)
        rows, loads = [], [load0]
        try:
            for row, seen in run_models(entries, cfg, data, args.out, updates, deadline, args.gpu,
                                        args.log_interval, progress):
                rows.append(row)
                loads += seen
                run_info = {"updates": updates, "minutes": args.minutes, "seed": cfg["seed"],
                            "baseline": cfg["baseline"], "device": "GPU" if args.gpu else f"CPU ({cores} cores)",
                            "cores": cores, "threads": threads, "models": len(entries),
                            "load": {"mean": sum(loads) / len(loads), "max": max(loads)},
                            "seconds": time.monotonic() - start}
                # after every model, so that an interrupted demo keeps what it finished
                table = write_results(rows, run_info, args.out)
        finally:
            progress.close()
    print("\n" + table + f"\nsaved {args.out / 'demo.md'} and {args.out / 'demo.png'} "
          f"({clock(run_info['seconds'])})", flush=True)
    if args.lm:
        language_model_part(args.out / "lm", threads)
    return rows


if __name__ == "__main__":
    main()
