"""Each model's training speed against the stock transformer's, as users train: fairseq's data, flags and CLI.

    python -m scripts.benchmark_models --raw-dir path/to/multi30k        # 3+3 layers d 256, 4096 tokens
    python -m scripts.benchmark_models --sizes tiny --train-sentences 400 --updates 1 --rounds 1 \\
        --train-updates 4 --log-interval 1                               # seconds; what the tests run

The data is what the recipes and the demo train on: Multi30K En-De, cased, Moses-tokenized, one
joint BPE (``--bpe-merges``, the recipes' 8,000 by default), one joined dictionary and shared
embeddings (``--share-all-embeddings``), prepared once into ``--data-dir``. Every model is
fairseq-train's: the demo's recipe (``configs/demo.yaml``: its architectures, their options,
dropout, label-smoothed loss, Adam) at the size asked for, ``--max-tokens`` per batch,
``--threads`` CPU threads. Two measurements, both alternating the models so that load from other
jobs on a shared machine hits all of them alike:

* one update (forward, backward, Adam step) in this process, on fairseq's own batches (the
  training set's seeded, length-grouped batches; round r times batch r for every model):
  median seconds per update over ``--updates`` rounds after one warm-up, ratio to the
  transformer's per round, and the ATen ops whose time grew most (``torch.profiler``);
* the real ``fairseq-train`` for ``--train-updates`` updates per model and round, ``--rounds``
  rounds: fairseq's own words (target tokens) per second from its progress lines, the first
  interval (warm-up) left out; the time-per-update ratio to the transformer is the inverse ratio
  of words per second (every model trains on the same batches).

``--profile-split`` also prints where each model's update goes by part of the model
(``profile_split``), and the floor that BPT's and SegTree's design sets (span rows through
the projections and the FFN) and how far each model is above it. Writes a JSON and a Markdown
table (``--out``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List

import torch

from fairseq_plugins.recipes.config import CONFIG_DIR, to_flags
from fairseq_plugins.recipes.demo import load_demo_config, prepare_multi30k, train_command
from fairseq_plugins.recipes.train_log import progress
from scripts.profile_split import floor_table, median_split, span_floor, split_table, update_split

REPO = Path(__file__).resolve().parents[1]
BASELINE = "transformer"

SIZES = {  # fairseq-train model flags (encoder and decoder alike), tokens per batch
    "small": (dict(layers=3, embed_dim=256, ffn_embed_dim=1024, attention_heads=4), 4096),  # the setting
    "demo": (dict(layers=2, embed_dim=128, ffn_embed_dim=256, attention_heads=4), 2048),  # configs/demo.yaml
    "tiny": (dict(layers=1, embed_dim=32, ffn_embed_dim=64, attention_heads=2), 256),  # the test suite's
}
TOP_OPS = 6


def size_flags(size: str) -> Dict[str, object]:
    dims, _ = SIZES[size]
    return {f"{side}-{key.replace('_', '-')}": value for side in ("encoder", "decoder") for key, value in dims.items()}


def model_flags(entry: dict, cfg: dict, size: str, max_tokens: int) -> List[str]:
    """fairseq-train's model and training flags for one of the demo's architectures at ``size``."""
    model = {**cfg["model"], **size_flags(size), **entry.get("model", {})}
    train = {**cfg["train"], "max-tokens": max_tokens}
    return ["--arch", entry["arch"], *to_flags(model), *to_flags(train), "--seed", str(cfg["seed"])]


def build_for_update(data: Path, flags: List[str]):
    """fairseq's task, model and criterion from the fairseq-train flags, as fairseq-train builds them."""
    from fairseq import options, tasks

    from fairseq_plugins.recipes.config import USER_DIR

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data), "--user-dir", str(USER_DIR), "--cpu", *flags])
    task = tasks.setup_task(args)
    torch.manual_seed(args.seed)
    model, criterion = task.build_model(args), task.build_criterion(args)
    return args, task, model, criterion


def training_batches(task, args, model, count: int) -> List[dict]:
    """The first ``count`` batches of fairseq-train's first epoch (seeded, length-grouped)."""
    from fairseq import utils

    task.load_dataset("train")
    epoch = task.get_batch_iterator(
        dataset=task.dataset("train"), max_tokens=args.max_tokens,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True, seed=args.seed, num_workers=0,
    ).next_epoch_itr(shuffle=True)
    batches = [next(epoch) for _ in range(min(count, len(epoch)))]
    if len(batches) < count:
        raise ValueError(f"the training set has {len(batches)} batches of {args.max_tokens} tokens; "
                         f"{count} were asked for (fewer --updates or more --train-sentences)")
    return batches


def update(model, criterion, optimizer, sample) -> None:
    """One training update: fairseq's criterion, backward, Adam step."""
    optimizer.zero_grad()
    loss, _, _ = criterion(model, sample)
    loss.backward()
    optimizer.step()


def plain_batch(sample) -> dict:
    """A fairseq sample as ``profile_split`` reads it."""
    return dict(**sample["net_input"], target=sample["target"])


def op_seconds(step) -> Counter:
    """Self CPU seconds of every ATen op over one update."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return Counter({event.key: event.self_cpu_time_total / 1e6 for event in prof.key_averages()})


def one_update_timings(data: Path, entries: List[dict], cfg: dict, size: str, args) -> dict:
    """Median seconds per update of every model in this process, alternating, and its profile."""
    max_tokens = args.max_tokens or SIZES[size][1]
    built = {e["arch"]: build_for_update(data, model_flags(e, cfg, size, max_tokens)) for e in entries}
    fs_args, task, model, _ = built[BASELINE]
    batches = training_batches(task, fs_args, model, args.updates + 1)
    optimizers = {name: torch.optim.Adam(b[2].parameters(), lr=1e-4) for name, b in built.items()}
    times = {name: [] for name in built}
    from tqdm import tqdm

    for rnd in tqdm(range(args.updates + 1), desc=f"{size} updates", file=sys.stderr):
        for name, (_, _, model, criterion) in built.items():
            model.train()
            start = time.perf_counter()
            update(model, criterion, optimizers[name], batches[rnd])
            if rnd:  # round 0 warms up (and builds the graphs' caches)
                times[name].append(time.perf_counter() - start)
    sample = batches[1 if args.updates else 0]
    ops = {name: op_seconds(lambda m=b[2], c=b[3], o=optimizers[name]: update(m, c, o, sample))
           for name, b in built.items()}
    split = floors = None
    if args.profile_split:
        batch, pad = plain_batch(sample), task.target_dictionary.pad()
        rounds = {name: [] for name in built}
        for _ in range(args.split_rounds):  # alternating, as the timed updates
            for name, b in built.items():
                rounds[name].append(update_split(b[2], optimizers[name], batch, pad))
        split = {name: median_split(r) for name, r in rounds.items()}
        floors = {name: span_floor(split[BASELINE], split[name], b[2], batch, pad) for name, b in built.items()}
    results = {}
    for name in built:
        ratios = [t / b for t, b in zip(times[name], times[BASELINE])]
        extra = ops[name].copy()
        extra.subtract(ops[BASELINE])
        results[name] = dict(
            seconds_per_update=statistics.median(times[name]),
            time_ratio=statistics.median(ratios),
            ratio_range=[min(ratios), max(ratios)],
            seconds_each_update=times[name],
            profiled_seconds=sum(ops[name].values()),
            extra_ops=[(op, s) for op, s in extra.most_common(TOP_OPS) if s > 0],
            parameters=sum(p.numel() for p in built[name][2].parameters()),
        )
    tokens = [int(b["net_input"]["src_lengths"].sum()) for b in batches[1:]] or [0]
    meta = dict(batches=len(batches) - 1, dictionary=len(task.target_dictionary),
                source_tokens_median=statistics.median(tokens),
                sentences_median=statistics.median(b["nsentences"] for b in batches[1:] or batches),
                max_tokens=max_tokens)
    return dict(meta=meta, results=results, split=split, floors=floors)


def fairseq_train_wps(data: Path, entry: dict, cfg: dict, size: str, args, save_dir: Path) -> float:
    """fairseq-train's own words per second over ``--train-updates`` updates, warm-up interval left out."""
    max_tokens = args.max_tokens or SIZES[size][1]
    run_cfg = {**cfg, "model": {**cfg["model"], **size_flags(size)},
               "train": {**cfg["train"], "max-tokens": max_tokens}}
    cmd = train_command(entry, run_cfg, data, save_dir, args.train_updates, None, False, args.log_interval)
    cmd += ["--no-save", "--disable-validation"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"fairseq-train failed for {entry['arch']}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    speeds = [wps for wps, _ in progress(proc.stdout + proc.stderr)]
    if len(speeds) < 2:
        raise RuntimeError(f"fairseq-train ({entry['arch']}) logged {len(speeds)} progress lines; "
                           f"the warm-up interval needs another after it:\n{proc.stdout[-2000:]}")
    return statistics.median(speeds[1:])


def fairseq_train_speeds(data: Path, entries: List[dict], cfg: dict, size: str, args) -> dict:
    """Words per second of every model's fairseq-train, ``--rounds`` rounds, models alternating."""
    wps = {e["arch"]: [] for e in entries}
    with tempfile.TemporaryDirectory(prefix="benchmark_models-") as save_dir:  # --no-save: stays empty
        for rnd in range(args.rounds):
            for entry in entries:
                speed = fairseq_train_wps(data, entry, cfg, size, args, Path(save_dir) / entry["arch"])
                wps[entry["arch"]].append(speed)
                print(f"fairseq-train round {rnd + 1}/{args.rounds}, {entry['arch']}: {speed:.0f} words/s",
                      file=sys.stderr, flush=True)
    out = {}
    for name, speeds in wps.items():
        ratios = [b / s for s, b in zip(speeds, wps[BASELINE])]  # time per update, per round
        out[name] = dict(words_per_second=statistics.median(speeds), words_per_second_each_round=speeds,
                         time_ratio=statistics.median(ratios), ratio_range=[min(ratios), max(ratios)])
    return out


def table(size: str, run: dict, rounds: int, updates: int) -> str:
    meta = run["meta"]
    dims, _ = SIZES[size]
    lines = [f"### {size}: {dims['layers']}+{dims['layers']} layers, d {dims['embed_dim']}, FFN "
             f"{dims['ffn_embed_dim']}, {meta['max_tokens']} tokens per batch (median {meta['sentences_median']:g} "
             f"sentences, {meta['source_tokens_median']:g} source tokens), joint dictionary of "
             f"{meta['dictionary']:,} types, shared embeddings", "",
             f"| model | parameters | one update: s (median of {updates}) | x transformer | range | "
             f"fairseq-train words/s (median of {rounds}) | x transformer (time per update) | range "
             "| ops that grew most in one update (s, profiled) |",
             "|---|---:|---:|---:|---|---:|---:|---|---|"]
    for name, r in run["results"].items():
        t = run["fairseq_train"][name]
        extra = ", ".join(f"`{op}` +{seconds:.3f}" for op, seconds in r["extra_ops"]) or "-"
        lines.append(f"| {name} | {r['parameters']:,} | {r['seconds_per_update']:.3f} | {r['time_ratio']:.2f}x | "
                     f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}x | {t['words_per_second']:.0f} | "
                     f"{t['time_ratio']:.2f}x | {t['ratio_range'][0]:.2f}-{t['ratio_range'][1]:.2f}x | "
                     f"{extra if name != BASELINE else '-'} |")
    if run["split"]:
        lines += ["", "Seconds per update by part of the model (profiled, median of the split rounds):", "",
                  split_table(run["split"], BASELINE), "", floor_table(run["floors"], BASELINE)]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small"])
    p.add_argument("--models", nargs="+", help="arch names of --config (default: all)")
    p.add_argument("--config", type=Path, default=CONFIG_DIR / "demo.yaml", help="the recipe: architectures, "
                   "their options, dropout, loss, optimizer (its sizes are replaced by --sizes')")
    p.add_argument("--max-tokens", type=int, help="tokens per batch (default: the size's)")
    p.add_argument("--updates", type=int, default=5, help="timed in-process updates per model (after one warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="fairseq-train runs per model, models alternating")
    p.add_argument("--train-updates", type=int, default=40, help="updates per fairseq-train run")
    p.add_argument("--log-interval", type=int, default=10, help="updates per fairseq-train progress line")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (torch here, OMP_NUM_THREADS for fairseq-train)")
    p.add_argument("--profile-split", action="store_true", help="print each model's time by part of the model "
                   "and its distance from the span-row floor")
    p.add_argument("--split-rounds", type=int, default=3, help="profiled updates per model for --profile-split")
    p.add_argument("--bpe-merges", type=int, default=8000, help="joint BPE merges (the Multi30K recipe's)")
    p.add_argument("--train-sentences", type=int, help="use only the first N pairs of every split (tiny runs)")
    p.add_argument("--raw-dir", type=Path, help="local Multi30K raw files (default: download once into the cache)")
    p.add_argument("--data-dir", type=Path, help="the prepared data-bin (default: under results/, reused)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "models")
    args = p.parse_args(argv)
    if args.train_updates < 2 * args.log_interval:
        p.error("--train-updates must cover two --log-interval's: the first (warm-up) is left out")
    if min(args.updates, args.rounds, args.split_rounds, args.threads) < 1:
        p.error("--updates, --rounds, --split-rounds and --threads must be positive")
    cfg = load_demo_config(args.config)
    entries = cfg["architectures"]
    if args.models:
        unknown = set(args.models) - {e["arch"] for e in entries}
        if unknown:
            p.error(f"--models {sorted(unknown)} not in {args.config}")
        entries = [e for e in entries if e["arch"] in args.models]
    if BASELINE not in [e["arch"] for e in entries]:
        p.error(f"the {BASELINE} is the baseline: keep it in --models")
    entries.sort(key=lambda e: e["arch"] != BASELINE)
    torch.set_num_threads(args.threads)
    limit = f"-{args.train_sentences}" if args.train_sentences else ""
    data_dir = args.data_dir or REPO / "results" / "benchmark_models" / f"multi30k-bpe{args.bpe_merges}{limit}"
    data = prepare_multi30k(args.raw_dir, data_dir, args.bpe_merges, args.train_sentences, args.train_sentences)
    loads = [os.getloadavg()[0]]
    runs = {}
    for size in args.sizes:
        runs[size] = one_update_timings(data, entries, cfg, size, args)
        loads.append(os.getloadavg()[0])
        runs[size]["fairseq_train"] = fairseq_train_speeds(data, entries, cfg, size, args)
        loads.append(os.getloadavg()[0])
    command = " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"Each model against the stock transformer as users train (the demo's recipe, Multi30K En-De with a "
              f"joint {args.bpe_merges}-merge BPE and shared embeddings), models alternating: one update "
              f"(forward, backward, Adam) in one process on fairseq's batches, and fairseq-train's own words "
              f"per second over {args.train_updates} updates (first {args.log_interval} left out as warm-up). "
              f"{args.threads} threads, torch {torch.__version__}, {os.cpu_count()} CPUs, 1-min load average "
              f"{min(loads):.1f}-{max(loads):.1f} during the run; `python -m scripts.benchmark_models {command}`.")
    text = header + "\n\n" + "\n\n".join(table(s, r, args.rounds, args.updates) for s, r in runs.items()) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = dict(settings=settings, loads=loads, runs=runs)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out.with_suffix('.md')} and .json", file=sys.stderr)


if __name__ == "__main__":
    main()
