"""Each model's training update against the stock transformer's, in one process, on real batches.

    python -m scripts.benchmark_models                         # demo size and 3+3 layers d 256
    python -m scripts.benchmark_models --sizes demo --updates 3 --max-tokens 512

For every size, every model is built and trained on the same real Multi30K En-De batch
(word-level vocabularies, as ``scripts.benchmark_slowfast``), one update (forward, backward,
Adam step) at a time, the models in alternation so that load from other jobs on a shared
machine hits all of them alike. Prints each model's median time per update over
``--updates`` (after one warm-up) and its ratio to the transformer's, with the spread, and
where the extra time goes: the ATen ops whose time per update grew most against the
transformer's (``torch.profiler``, one more update each). Writes a JSON and a Markdown table.

``--profile-split`` also prints where each model's update goes by part of the model
(``profile_split``): forward and backward seconds of every module kind, so that the extra
time against the transformer splits into span nodes (projections, FFN, norms, dropout over
more rows), attention, relative keys, graph building and the rest.
"""

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from fairseq_plugins.check_gpu.model_update import MODELS, build_model, register_models, train_step
from scripts.benchmark_slowfast import build_batch
from scripts.profile_split import median_split, split_table, update_split

REPO = Path(__file__).resolve().parents[1]

SIZES = {  # (model sizes, source tokens per batch)
    "demo": (dict(encoder_embed_dim=128, encoder_ffn_embed_dim=256, encoder_attention_heads=4,
                  encoder_layers=2), 2048),  # configs/demo.yaml
    "small": (dict(encoder_embed_dim=256, encoder_ffn_embed_dim=1024, encoder_attention_heads=4,
                   encoder_layers=3), 4096),
    "tiny": (dict(encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_attention_heads=2,
                  encoder_layers=1), 256),  # the test suite's
}
TOP_OPS = 6


def op_seconds(model, optimizer, batch, pad) -> Counter:
    """Self CPU seconds of every ATen op over one update."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, optimizer, batch, pad)
    return Counter({event.key: event.self_cpu_time_total / 1e6 for event in prof.key_averages()})


def run_size(size: str, args) -> dict:
    dims, max_tokens = SIZES[size]
    dicts, batch = build_batch(args.max_tokens or max_tokens, args.raw_dir)
    pad = dicts["de"].pad()
    models = {name: build_model(arch, opts, dims, dicts) for name, (arch, opts) in MODELS.items()
              if name in args.models}
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-4) for name, m in models.items()}
    times = {name: [] for name in models}
    from tqdm import tqdm

    for update in tqdm(range(args.updates + 1), desc=f"{size} updates", file=sys.stderr):
        for name, model in models.items():
            start = time.perf_counter()
            train_step(model, optimizers[name], batch, pad)
            if update:  # update 0 warms up (and builds the graphs' caches)
                times[name].append(time.perf_counter() - start)
    ops = {name: op_seconds(model, optimizers[name], batch, pad) for name, model in models.items()}
    if args.profile_split:
        rounds = {name: [] for name in models}
        for _ in range(args.split_rounds):  # alternating, as the timed updates
            for name, model in models.items():
                rounds[name].append(update_split(model, optimizers[name], batch, pad))
        split = {name: median_split(r) for name, r in rounds.items()}
        print(f"{size}: seconds per update by part of the model, profiled, median of {args.split_rounds} "
              f"updates each\n" + split_table(split))
    base = statistics.median(times["transformer"])
    results = {}
    for name in models:
        ratios = [t / b for t, b in zip(times[name], times["transformer"])]  # per round
        extra = ops[name].copy()
        extra.subtract(ops["transformer"])
        results[name] = dict(
            seconds_per_update=statistics.median(times[name]),
            time_ratio=statistics.median(times[name]) / base,
            ratio_range=[min(ratios), max(ratios)],
            seconds_each_update=times[name],
            profiled_seconds=sum(ops[name].values()),
            extra_ops=[(op, seconds) for op, seconds in extra.most_common(TOP_OPS) if seconds > 0],
        )
    meta = dict(sentences=batch["src_tokens"].size(0), source_tokens=int(batch["src_lengths"].sum()),
                max_source_length=batch["src_tokens"].size(1), **dims)
    return dict(meta=meta, results=results)


def table(size: str, run: dict) -> str:
    meta = run["meta"]
    lines = [f"### {size}: {meta['encoder_layers']}+{meta['encoder_layers']} layers, d "
             f"{meta['encoder_embed_dim']}, FFN {meta['encoder_ffn_embed_dim']}, "
             f"{meta['sentences']} sentences / {meta['source_tokens']} source tokens per batch "
             f"(longest {meta['max_source_length']})", "",
             "| model | s / update | x transformer (median) | range over rounds "
             "| ops that grew most (s per update, profiled) |",
             "|---|---|---|---|---|"]
    for name, r in run["results"].items():
        extra = ", ".join(f"`{op}` +{seconds:.3f}" for op, seconds in r["extra_ops"]) or "-"
        lines.append(f"| {name} | {r['seconds_per_update']:.3f} | {r['time_ratio']:.2f}x | "
                     f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}x | "
                     f"{extra if name != 'transformer' else '-'} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["demo", "small"])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--max-tokens", type=int, help="source tokens per batch (default: the size's)")
    p.add_argument("--updates", type=int, default=5, help="timed updates per model (after one warm-up)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--profile-split", action="store_true", help="print each model's time by part of the model")
    p.add_argument("--split-rounds", type=int, default=3, help="profiled updates per model for --profile-split")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "models")
    p.add_argument("--raw-dir", type=Path, help="local Multi30K raw files (default: download once into the cache)")
    args = p.parse_args(argv)
    if "transformer" not in args.models:
        p.error("the transformer is the baseline: keep it in --models")
    torch.set_num_threads(args.threads)
    register_models()
    runs = {size: run_size(size, args) for size in args.sizes}
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    header = (f"One training update (forward, backward, Adam) of each model against the stock "
              f"transformer, alternating, median of {args.updates} rounds, {args.threads} threads, "
              f"torch {torch.__version__}, load average {load} at the end; "
              f"`python -m scripts.benchmark_models {' '.join(argv if argv is not None else sys.argv[1:])}`.")
    text = header + "\n\n" + "\n\n".join(table(size, run) for size, run in runs.items()) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(dict(threads=args.threads, runs=runs), indent=2) + "\n")
    print(f"wrote {args.out.with_suffix('.md')} and .json", file=sys.stderr)


if __name__ == "__main__":
    main()
