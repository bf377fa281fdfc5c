"""Benchmark BPT graph attention (PyTorch backend) against dense attention on CPU.

For each length n (8192 tokens per batch, 8 heads, head dim 64) and each k, times forward +
backward of (a) the attention op alone and (b) one full encoder layer (d 512, FFN 2048), with
the BPT graph over ~2n nodes against torch's fused ``scaled_dot_product_attention`` over the n
tokens. Times: for each (part, n), dense and every k are built in one process and run in
alternation, ``--repeats`` rounds, keeping each one's fastest step, so that load from other
jobs on a shared machine hits all of them alike. Peak memory: the growth of the peak RSS over
one forward+backward step (inputs already allocated), each configuration in a fresh process.
Prints ratios (dense / BPT: above 1 means BPT is faster or smaller) and time(2n) / time(n), and
writes a markdown table and a PNG.

    python scripts/benchmark_graph_attention.py                       # full: n 256..8192
    python scripts/benchmark_graph_attention.py --lengths 256 1024 2048 --ks 1 4 --repeats 1
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_step(kind: str, n: int, k: int, tokens: int, threads: int):
    """A closure running one forward+backward of the configuration (k = 0: dense SDPA)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    sys.path.insert(0, str(REPO))
    from fairseq_plugins.graphs.binary_partition import bpt_graph
    from fairseq_plugins.graph_attention import graph_attention
    from fairseq_plugins.modules.bpt.graph_self_attention import GraphSelfAttention
    from fairseq_plugins.modules.common.heads import merge_heads, split_heads

    torch.set_num_threads(threads)
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
                   else graph_attention(q, key, v, graph, rel, backend="torch"))
            out.backward(grad_out)
    else:
        class Layer(nn.Module):
            """Post-norm transformer encoder layer; attention dense or over the graph."""

            def __init__(self):
                super().__init__()
                self.attn = GraphSelfAttention(model_dim, heads, 1 if dense else graph.num_edge_types)
                self.norm1, self.norm2 = nn.LayerNorm(model_dim), nn.LayerNorm(model_dim)
                self.ffn = nn.Sequential(nn.Linear(model_dim, 2048), nn.ReLU(),
                                         nn.Linear(2048, model_dim))

            def forward(self, x):
                if dense:
                    a = self.attn
                    q, key, v = (split_heads(p(x), heads) for p in (a.q_proj, a.k_proj, a.v_proj))
                    h = a.out_proj(merge_heads(F.scaled_dot_product_attention(q, key, v)))
                else:
                    with self.attn.attending(graph):
                        h, _ = self.attn(x)
                x = self.norm1(x + h)
                return self.norm2(x + self.ffn(x))

        layer = Layer()
        x = torch.randn(nodes, bsz, model_dim, requires_grad=True)

        grad_out = torch.randn(nodes, bsz, model_dim)

        def step():
            layer(x).backward(grad_out)

    return step


def time_worker(kind: str, n: int, ks, tokens: int, repeats: int, threads: int) -> dict:
    """Fastest forward+backward of dense (k = 0) and of every k, run in alternation."""
    steps = {k: build_step(kind, n, k, tokens, threads) for k in [0] + list(ks)}
    for step in steps.values():
        step()  # warm-up (also builds and caches the graph's plan)
    best = {k: float("inf") for k in steps}
    for _ in range(repeats):
        for k, step in steps.items():
            start = time.perf_counter()
            step()
            best[k] = min(best[k], time.perf_counter() - start)
    return {str(k): seconds for k, seconds in best.items()}


def memory_worker(kind: str, n: int, k: int, tokens: int, threads: int) -> float:
    """Peak RSS growth (MB) of one forward+backward, inputs already allocated."""
    step = build_step(kind, n, k, tokens, threads)
    base = peak_rss_mb()
    step()
    return peak_rss_mb() - base


def run_worker(*worker_args, args) -> object:
    cmd = [sys.executable, __file__, "--worker", *map(str, worker_args), "--tokens",
           str(args.tokens), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "graph_attention")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, kind, n, *ks = args.worker
        if mode == "time":
            result = time_worker(kind, int(n), [int(k) for k in ks], args.tokens, args.repeats,
                                 args.threads)
        else:
            result = memory_worker(kind, int(n), int(ks[0]), args.tokens, args.threads)
        print(json.dumps(result))
        return
    if any(k < 1 for k in args.ks) or any(n < 1 for n in args.lengths):
        parser.error("lengths and ks must be positive")

    results = {}
    pairs = [(kind, n) for kind in ("op", "layer") for n in args.lengths]
    for i, (kind, n) in enumerate(pairs, 1):
        print(f"[{i}/{len(pairs)}] {kind} n={n}:", end=" ", flush=True)
        seconds = run_worker("time", kind, n, *args.ks, args=args)
        for k in [0] + args.ks:
            peak = run_worker("memory", kind, n, k, args=args)
            results[kind, n, k] = {"seconds": seconds[str(k)], "peak_mb": peak}
            label = "dense" if k == 0 else f"k={k}"
            print(f"{label} {seconds[str(k)]:.3f} s +{peak:.0f} MB", end="; ", flush=True)
        print(flush=True)

    lines = ["| part | n | k | BPT s | dense s | speed (dense/BPT) | memory (dense/BPT) | BPT time(n)/time(n/2) |",
             "|---|---|---|---|---|---|---|---|"]
    for kind in ("op", "layer"):
        for k in args.ks:
            for n in args.lengths:
                r, d = results[kind, n, k], results[kind, n, 0]
                prev = results.get((kind, n // 2, k))
                growth = f"{r['seconds'] / prev['seconds']:.2f}" if prev else "-"
                lines.append(f"| {kind} | {n} | {k} | {r['seconds']:.3f} | {d['seconds']:.3f} | "
                             f"{d['seconds'] / r['seconds']:.2f}x | "
                             f"{max(d['peak_mb'], 1) / max(r['peak_mb'], 1):.2f}x | {growth} |")
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(
        f"Forward+backward, {args.tokens} tokens per batch, 8 heads x 64, {args.threads} threads, "
        f"PyTorch backend vs F.scaled_dot_product_attention; fastest of {args.repeats} alternating "
        f"rounds. {machine_line()}\n\n{table}\n")
    plot(results, args)


def machine_line() -> str:
    """Where and with what the numbers were measured (they only compare within one run)."""
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
            f"`python scripts/benchmark_graph_attention.py {' '.join(sys.argv[1:])}`.")


def plot(results, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("op", "layer")):
        for k in [0] + args.ks:
            ax.plot(args.lengths, [results[kind, n, k]["seconds"] for n in args.lengths], marker="o",
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
