"""Benchmark BPT graph attention (``--backend``, default auto) against dense attention on CPU.

For each length n (8192 tokens per batch, 8 heads, head dim 64) and each k, times forward +
backward of (a) the attention op alone and (b) one full encoder layer (d 512, FFN 2048), with
the BPT graph over ~2n nodes against torch's fused ``scaled_dot_product_attention`` over the n
tokens. Times: for each (part, n), dense and every k are built in one process and run in
alternation at every ``--threads`` count, ``--repeats`` rounds; the table gives each one's
median and the range of the per-round ratio dense / BPT, so that load from other jobs on a
shared machine hits all of them alike and shows. Peak memory: the peak RSS during one
forward+backward step above the RSS before it (inputs and the graph's cached plan already
there; the peak is reset first, so building the graph does not hide it), each configuration
in a fresh process. Prints ratios (dense / BPT: above 1 means BPT is faster or
smaller), time(2n) / time(n) and, with two thread counts, BPT's speed-up from the first to the
last; writes a markdown table and a PNG. ``--backend`` picks the graph attention backend of
BPT: auto (what the models use: the fused C++ kernel ``cpu`` where it is built and trusted),
cpu, or torch (the pure-PyTorch tree path).

    python scripts/benchmark_graph_attention.py                       # full: n 256..8192
    python scripts/benchmark_graph_attention.py --lengths 1024 8192 --ks 4 --threads 1 2
    python scripts/benchmark_graph_attention.py --backend torch      # the torch tree path
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def reset_peak_rss() -> bool:
    """Set the process's peak RSS to its current RSS (Linux: ``/proc/self/clear_refs``), so
    that a step's peak is measured even below the peak of building its graph; False where
    the kernel does not allow it (the peak then only counts growth above the earlier one)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def rss_mb(field: str = "VmHWM") -> float:
    """The process's peak (``VmHWM``) or current (``VmRSS``) resident memory in MB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_step(kind: str, n: int, k: int, tokens: int, backend: str):
    """A closure running one forward+backward of the configuration (k = 0: dense SDPA)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    sys.path.insert(0, str(REPO))
    from fairseq_plugins.graphs.binary_partition import bpt_graph
    from fairseq_plugins.graph_attention import graph_attention
    from fairseq_plugins.modules.bpt.graph_self_attention import GraphSelfAttention
    from fairseq_plugins.modules.common.heads import merge_heads, split_heads

    torch.manual_seed(0)
    bsz, heads, dim, model_dim = max(tokens // n, 1), 8, 64, 512
    dense = k == 0
    graph = None if dense else bpt_graph(n, k)
    nodes = n if dense else graph.num_nodes

    if kind == "op":
        qkv = [torch.randn(bsz, heads, nodes, dim, requires_grad=True) for _ in range(3)]
        rel = None if dense else torch.randn(graph.num_edge_types, dim, requires_grad=True)

        # a dense output gradient, as in a model (out.sum() would give a stride-0 one)
        grad_out = torch.randn(bsz, heads, nodes, dim)

        def step():
            q, key, v = qkv
            out = (F.scaled_dot_product_attention(q, key, v) if dense
                   else graph_attention(q, key, v, graph, rel, backend=backend))
            out.backward(grad_out)
    else:
        class Layer(nn.Module):
            """Post-norm transformer encoder layer; attention dense or over the graph."""

            def __init__(self):
                super().__init__()
                self.attn = GraphSelfAttention(model_dim, heads, 1 if dense else graph.num_edge_types,
                                               backend=backend)
                self.norm1, self.norm2 = nn.LayerNorm(model_dim), nn.LayerNorm(model_dim)
                self.ffn = nn.Sequential(nn.Linear(model_dim, 2048), nn.ReLU(),
                                         nn.Linear(2048, model_dim))

            def forward(self, x):
                if dense:
                    a = self.attn
                    q, key, v = (split_heads(p(x), heads) for p in (a.q_proj, a.k_proj, a.v_proj))
                    h = a.out_proj(merge_heads(F.scaled_dot_product_attention(q, key, v)))
                else:
                    h = self.attn(x, graph)
                x = self.norm1(x + h)
                return self.norm2(x + self.ffn(x))

        layer = Layer()
        x = torch.randn(nodes, bsz, model_dim, requires_grad=True)

        grad_out = torch.randn(nodes, bsz, model_dim)

        def step():
            layer(x).backward(grad_out)

    if not dense:  # the graph's plans (cached on the graph, built once per length) and the
        small = torch.zeros(1, 1, nodes, dim)  # backend's self-check are not a step
        graph_attention(small, small, small, graph, torch.zeros(graph.num_edge_types, dim),
                        backend=backend)
    return step


def time_worker(kind: str, n: int, ks, tokens: int, repeats: int, threads, backend: str) -> dict:
    """Seconds of every forward+backward of dense (k = 0) and of every k at every thread
    count, run in alternation: {threads: {k: [seconds per round]}}."""
    import torch

    steps = {k: build_step(kind, n, k, tokens, backend) for k in [0] + list(ks)}
    seconds = {t: {k: [] for k in steps} for t in threads}
    for round_ in range(repeats + 1):
        for t in threads:
            torch.set_num_threads(t)
            for k, step in steps.items():
                start = time.perf_counter()
                step()
                if round_:  # round 0 warms up
                    seconds[t][k].append(time.perf_counter() - start)
    return {str(t): {str(k): v for k, v in by_k.items()} for t, by_k in seconds.items()}


def memory_worker(kind: str, n: int, k: int, tokens: int, threads: int, backend: str) -> float:
    """Peak RSS growth (MB) of one forward+backward, inputs already allocated."""
    import torch

    torch.set_num_threads(threads)
    step = build_step(kind, n, k, tokens, backend)
    base = rss_mb("VmRSS") if reset_peak_rss() else rss_mb()
    step()
    return rss_mb() - base


def run_worker(*worker_args, args) -> object:
    cmd = [sys.executable, __file__, "--worker", *map(str, worker_args), "--tokens",
           str(args.tokens), "--repeats", str(args.repeats), "--threads", *map(str, args.threads),
           "--backend", args.backend]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--parts", nargs="+", choices=["op", "layer"], default=["op", "layer"])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up)")
    parser.add_argument("--threads", type=int, nargs="+", default=[2],
                        help="thread counts, timed in alternation (memory: the last)")
    parser.add_argument("--backend", default="auto", choices=["auto", "cpu", "torch"],
                        help="graph attention backend of BPT (auto: what the models use)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "graph_attention")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, kind, n, *ks = args.worker
        if mode == "time":
            result = time_worker(kind, int(n), [int(k) for k in ks], args.tokens, args.repeats,
                                 args.threads, args.backend)
        else:
            result = memory_worker(kind, int(n), int(ks[0]), args.tokens, args.threads[-1],
                                   args.backend)
        print(json.dumps(result))
        return
    if any(k < 1 for k in args.ks) or any(n < 1 for n in args.lengths):
        parser.error("lengths and ks must be positive")

    results = {}
    pairs = [(kind, n) for kind in args.parts for n in args.lengths]
    for i, (kind, n) in enumerate(pairs, 1):
        print(f"[{i}/{len(pairs)}] {kind} n={n}:", end=" ", flush=True)
        seconds = run_worker("time", kind, n, *args.ks, args=args)
        for k in [0] + args.ks:
            peak = run_worker("memory", kind, n, k, args=args)
            results[kind, n, k] = {"seconds": {int(t): v[str(k)] for t, v in seconds.items()},
                                   "peak_mb": peak}
            label = "dense" if k == 0 else f"k={k}"
            median = statistics.median(seconds[str(args.threads[-1])][str(k)])
            print(f"{label} {median:.3f} s +{peak:.0f} MB", end="; ", flush=True)
        print(flush=True)

    table = make_table(results, args)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    args.out.with_suffix(".md").write_text(
        f"Forward+backward, {args.tokens} tokens per batch, 8 heads x 64, BPT through the "
        f"graph attention backend {args.backend!r} vs "
        f"F.scaled_dot_product_attention; medians of {args.repeats} alternating rounds, the range "
        f"of the per-round ratio in brackets; memory at {args.threads[-1]} threads. "
        f"{machine_line()} Load average at the end: {load}.\n\n{table}\n")
    plot(results, args)


def make_table(results, args) -> str:
    """One row per (part, k, n, threads): medians, dense / BPT with its range over the rounds,
    memory, time(n) / time(n/2) and BPT's speed-up over the first thread count."""
    def median(kind, n, k, t):
        return statistics.median(results[kind, n, k]["seconds"][t])

    lines = ["| part | n | k | threads | BPT s | dense s | speed (dense/BPT) [range] | memory MB dense / BPT | "
             "BPT time(n)/time(n/2) | BPT speed-up vs " + f"{args.threads[0]} thread(s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind in args.parts:
        for k in args.ks:
            for n in args.lengths:
                r, d = results[kind, n, k], results[kind, n, 0]
                for t in args.threads:
                    ratios = [ds / bs for ds, bs in zip(d["seconds"][t], r["seconds"][t])]
                    growth = (f"{median(kind, n, k, t) / median(kind, n // 2, k, t):.2f}"
                              if (kind, n // 2, k) in results else "-")
                    lines.append(
                        f"| {kind} | {n} | {k} | {t} | {median(kind, n, k, t):.3f} | "
                        f"{median(kind, n, 0, t):.3f} | "
                        f"{median(kind, n, 0, t) / median(kind, n, k, t):.2f}x "
                        f"[{min(ratios):.2f}-{max(ratios):.2f}] | "
                        f"{d['peak_mb']:.0f} / {r['peak_mb']:.0f} | {growth} | "
                        f"{median(kind, n, k, args.threads[0]) / median(kind, n, k, t):.2f}x |")
    return "\n".join(lines)


def machine_line(command: str = "python scripts/benchmark_graph_attention.py") -> str:
    """Where and with what the numbers were measured (they only compare within one run);
    ``command`` is the script's, its arguments are this process's."""
    import datetime
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return (f"Measured {datetime.date.today()} on {cpu} ({torch.get_num_threads()} threads "
            f"available to torch), torch {torch.__version__}, "
            f"`{command} {' '.join(sys.argv[1:])}`.")


def plot(results, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.parts), figsize=(5.5 * len(args.parts), 4), squeeze=False)
    for ax, kind in zip(axes[0], args.parts):
        for k in [0] + args.ks:
            ax.plot(args.lengths, [statistics.median(results[kind, n, k]["seconds"][args.threads[-1]])
                                   for n in args.lengths], marker="o",
                    label="dense (SDPA)" if k == 0 else f"BPT k={k}")
        ax.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="seconds (fwd+bwd)",
               title=f"{'attention op' if kind == 'op' else 'encoder layer'}, {args.tokens} tokens/batch")
        ax.set_xticks(args.lengths, [str(n) for n in args.lengths])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=100)
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
