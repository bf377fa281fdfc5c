"""Long-context language models on CPU: one training update of ``bpt_lm`` (k 4, 16, 64) against
``transformer_lm`` (causal SDPA) of the same size, and sampling time per token.

    python -m scripts.benchmark_lm                                   # 2 layers d 256, contexts 1024-8192
    python -m scripts.benchmark_lm --contexts 128 256 --layers 1 --dim 32 --prefixes 16 64   # tiny

Training: every batch holds ``--tokens`` tokens (``--tokens / context`` sequences of one context
length, random bytes), one update is forward, cross-entropy, backward and an Adam step. One
warm-up round, then ``--rounds`` rounds in which the models alternate (so that other jobs on a
shared machine slow all of them alike); the median per model and context, tokens per second,
the ratio to ``transformer_lm``'s tokens per second measured in the same run, and time per token
relative to the shortest context. ``--checkpointed-ks`` adds BPT with fairseq's
``--checkpoint-activations`` (training only): the layers' activations recomputed in the
backward, memory traded for time; ``--recomputed-ks`` adds BPT with
``--graph-recompute-norms-ffn`` (the layer norms and the FFN's hidden states recomputed), alone
and with ``--checkpoint-activations``. Peak memory: two updates in a fresh process per model and
context, peak resident memory above the built model's (``/proc/self/clear_refs``), with
glibc's allocator returning every freed tensor (``MEMORY_ENV``), so that the peak is what
the updates hold, not what the allocator cached.

Sampling: incremental decoding (fairseq's ``incremental_state``) of one sequence to each
``--prefixes`` length; the time per token of the last ``--sample-steps`` steps before it.
Estimates of where the rest of BPT's time goes are not made here: ``scripts/benchmark_models.py
--profile-split`` splits an update by part of the model.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import torch

from fairseq_plugins.check_gpu.lm_update import VOCAB, build_lm, lm_specs, lm_update_step
from scripts.benchmark_graph_attention import machine_line, reset_peak_rss, rss_mb



def build(arch, extra, args, context):
    return build_lm(arch, extra, args.layers, args.dim, args.heads, context, args.backend)


# Peak memory is measured as resident memory: glibc keeps freed blocks below its (adaptive)
# mmap threshold, so the process's peak would show what the allocator cached rather than what
# the update held. A fixed threshold of 64 KiB maps every tensor of that size or more on its
# own and returns it on free: the peak then follows the live tensors.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
MEMORY_UPDATES = 2


def memory_worker(name, args, context) -> float:
    """Peak resident memory of ``MEMORY_UPDATES`` updates above the memory of the built model:
    the activations and their gradients, and what the first update adds for good (Adam's
    state, fairseq's cached causal mask, BPT's graph)."""
    arch, extra = lm_specs(args.ks, args.checkpointed_ks, args.recomputed_ks)[name]
    step = lm_update_step(build(arch, extra, args, context), args.tokens, context)
    base = rss_mb("VmRSS") if reset_peak_rss() else rss_mb()
    for _ in range(MEMORY_UPDATES):
        step()
    return rss_mb() - base


def peak_growth(name, args, context) -> float:
    cmd = [sys.executable, "-m", "scripts.benchmark_lm", "--memory-worker", name, str(context), *common_flags(args)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, **MEMORY_ENV})
    return float(out.stdout.strip().splitlines()[-1])


def common_flags(args):
    return ["--ks", *map(str, args.ks), "--checkpointed-ks", *map(str, args.checkpointed_ks),
            "--recomputed-ks", *map(str, args.recomputed_ks),
            "--layers", str(args.layers), "--dim", str(args.dim), "--heads", str(args.heads),
            "--tokens", str(args.tokens), "--threads", str(args.threads), "--backend", args.backend]


def time_updates(args):
    specs = lm_specs(args.ks, args.checkpointed_ks, args.recomputed_ks)
    seconds = {name: {c: [] for c in args.contexts} for name in specs}
    for context in args.contexts:
        steps = {name: lm_update_step(build(arch, extra, args, context), args.tokens, context)
                 for name, (arch, extra) in specs.items()}
        for round_ in range(args.rounds + 1):
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                if round_:  # round 0 warms up
                    seconds[name][context].append(time.perf_counter() - start)
        print(f"context {context}: " + ", ".join(f"{n} {statistics.median(s[context]):.3f} s"
                                               for n, s in seconds.items()), flush=True)
    return seconds


@torch.no_grad()
def sampling_seconds_per_token(args):
    out = {}
    for name, (arch, extra) in lm_specs(args.ks).items():
        model = build(arch, extra, args, max(args.prefixes) + 1).eval()
        tokens = torch.randint(4, 4 + VOCAB, (1, max(args.prefixes)), generator=torch.Generator().manual_seed(1))
        state, times = {}, {}
        marks = sorted(args.prefixes)
        for t in range(max(marks)):
            start = time.perf_counter()
            model.decoder(tokens[:, :t + 1], incremental_state=state)
            elapsed = time.perf_counter() - start
            for mark in marks:
                if mark - args.sample_steps <= t < mark:
                    times.setdefault(mark, []).append(elapsed)
        out[name] = {m: statistics.median(times[m]) for m in marks}
        print(f"sampling {name}: " + ", ".join(f"{m}: {1e3 * s:.2f} ms" for m, s in out[name].items()), flush=True)
    return out


def train_table(train, args) -> List[str]:
    base = "transformer_lm"
    lines = [f"Training update, {args.layers} layers, d {args.dim}, {args.heads} heads, {args.tokens} tokens per "
             f"batch, {args.threads} threads, median of {args.rounds} alternating rounds (graph attention backend "
             f"{args.backend}).", "",
             "| model | context | s / update | tokens / s | vs transformer_lm | time per token vs shortest context "
             "| peak memory (MB) | vs transformer_lm |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, by_context in train.items():
        first = by_context[str(args.contexts[0])]["tokens_per_second"]
        for context in args.contexts:
            r, b = by_context[str(context)], train[base][str(context)]
            lines.append(f"| {name} | {context} | {r['seconds']:.3f} | {r['tokens_per_second']:.0f} | "
                         f"{r['tokens_per_second'] / b['tokens_per_second']:.2f}x | "
                         f"{first / r['tokens_per_second']:.2f} | {r['peak_mb']:.0f} | "
                         f"{r['peak_mb'] / b['peak_mb']:.2f}x |")
    return lines


def sampling_table(sampling, args) -> List[str]:
    prefixes = sorted(args.prefixes)
    lines = [f"Sampling (incremental decoding, batch 1): ms per token, median over the {args.sample_steps} steps "
             "before each prefix length, and the last prefix's time over the first's.", "",
             "| model | " + " | ".join(map(str, prefixes)) + f" | {prefixes[-1]} / {prefixes[0]} |",
             "|---|" + "---:|" * (len(prefixes) + 1)]
    for name, by_prefix in sampling.items():
        cells = [f"{1e3 * by_prefix[str(p)]:.2f}" for p in prefixes]
        growth = by_prefix[str(prefixes[-1])] / by_prefix[str(prefixes[0])]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {growth:.2f} |")
    return lines


def make_table(result, args) -> str:
    parts = []
    if "train" in result:
        parts.append(train_table(result["train"], args))
    if "sampling" in result:
        parts.append(sampling_table(result["sampling"], args))
    return "\n\n".join("\n".join(lines) for lines in parts) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--ks", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--checkpointed-ks", type=int, nargs="*", default=[4],
                   help="these ks also trained with --checkpoint-activations (training only)")
    p.add_argument("--recomputed-ks", type=int, nargs="*", default=[4],
                   help="these ks also trained with --graph-recompute-norms-ffn, alone and with "
                        "--checkpoint-activations")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per batch, every context")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="auto", help="--graph-attention-backend of bpt_lm")
    p.add_argument("--prefixes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--sample-steps", type=int, default=16)
    p.add_argument("--no-memory", action="store_true", help="skip the per-process peak memory runs")
    p.add_argument("--parts", nargs="+", choices=("train", "sampling"), default=["train", "sampling"],
                   help="what to measure (default both)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/lm_benchmark"))
    p.add_argument("--memory-worker", nargs=2, metavar=("MODEL", "CONTEXT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_worker:
        print(memory_worker(args.memory_worker[0], args, int(args.memory_worker[1])))
        return None
    if args.tokens < max(args.contexts):
        p.error("--tokens must hold at least one sequence of the longest context")
    machine = machine_line().replace("scripts/benchmark_graph_attention.py", "-m scripts.benchmark_lm")
    result = {"machine": machine, "args": vars(args) | {"out": str(args.out)}}
    load = [os.getloadavg()[0]]
    if "train" in args.parts:
        seconds = time_updates(args)
        result["train"] = {name: {str(c): {
            "seconds": statistics.median(s[c]), "all_seconds": s[c],
            "tokens_per_second": (args.tokens // c) * c / statistics.median(s[c]),
            "peak_mb": float("nan") if args.no_memory else peak_growth(name, args, c)}
            for c in args.contexts} for name, s in seconds.items()}
        load.append(os.getloadavg()[0])
    if "sampling" in args.parts:
        result["sampling"] = {n: {str(m): v for m, v in by.items()}
                              for n, by in sampling_seconds_per_token(args).items()}
        load.append(os.getloadavg()[0])
    # the machine may be shared: its 1-minute load average at the start and after each part
    result["load_average"] = load
    loads = ", ".join(f"{x:.1f}" for x in load)
    result["machine"] += f" Load average (1 min) at the start and after each part: {loads}."
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    table = make_table(result, args)
    args.out.with_suffix(".md").write_text(result["machine"] + "\n\n" + table)
    print(table)
    return result


if __name__ == "__main__":
    main()
