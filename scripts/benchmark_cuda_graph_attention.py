#!/usr/bin/env python
"""GPU benchmark of a BPT encoder: fused CUDA and Triton kernels vs FlexAttention vs dense attention.

The BPT paper's speed/memory setting (Sec. 4.4, Figures 6-7): 6 layers, d 512, FFN 2048,
8 heads, 8192 tokens per batch, lengths n from 512 to 16384, k in {1, 4, 16, 64}. One run
measures forward+backward time and peak memory of

* dense:  the same encoder with F.scaled_dot_product_attention over the n tokens
          (FlashAttention on recent GPUs); independent of k;
* flex:   graph attention over the BPT graph (~2n nodes) with the "flex" backend (compiled);
* cuda:   the same with the fused kernels of cuda_ext/ ("cuda" backend);
* triton: the same with the Triton band kernels ("triton" backend);

and writes benchmarks/cuda_graph_attention.{json,md,png}: the table with each graph backend's
ratio against dense measured in the same run, the GPU model and versions. Needs a CUDA GPU;
no fairseq.
"""

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_plugins.command_line import import_extra  # noqa: E402
from fairseq_plugins.graphs.binary_partition import bpt_graph  # noqa: E402
from fairseq_plugins.graph_attention import cuda_backend, flex_backend  # noqa: E402,F401
from fairseq_plugins.graph_attention import graph_attention  # noqa: E402


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer; attention over all tokens (dense) or over a graph."""

    def __init__(self, dim, ffn_dim, heads, num_edge_types):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.ReLU(), nn.Linear(ffn_dim, dim))
        self.rel_key = nn.Parameter(0.02 * torch.randn(num_edge_types, dim // heads))

    def forward(self, x, graph, backend):
        bsz, length, dim = x.shape
        q, k, v = (self.qkv(self.attn_norm(x)).view(bsz, length, 3, self.heads, -1)
                   .permute(2, 0, 3, 1, 4))
        if backend == "dense":
            attn = F.scaled_dot_product_attention(q, k, v)
        else:
            attn = graph_attention(q, k, v, graph, self.rel_key, backend=backend)
        x = x + self.out(attn.transpose(1, 2).reshape(bsz, length, dim))
        return x + self.ffn(self.ffn_norm(x))


class Encoder(nn.Module):
    def __init__(self, layers, dim, ffn_dim, heads, num_edge_types):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(dim, ffn_dim, heads, num_edge_types)
                                    for _ in range(layers))

    def forward(self, tokens, graph, backend):
        if backend == "dense":
            x = tokens
        else:  # span nodes start as zeros after the token nodes (BPT)
            spans = tokens.new_zeros(tokens.size(0), graph.num_nodes - tokens.size(1), tokens.size(2))
            x = torch.cat([tokens, spans], 1)
        for layer in self.layers:
            x = layer(x, graph, backend)
        return x[:, : tokens.size(1)]


def measure(model, tokens, graph, backend, warmup, iters):
    """(seconds per forward+backward, peak GiB) or None when out of memory."""
    def step():
        model(tokens, graph, backend).float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    try:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / iters, torch.cuda.max_memory_allocated() / 2**30
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return None


def environment():
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M")}


def write_table(results, env, args, path):
    graph_backends = [b for b in args.backends if b != "dense"]
    lines = [
        "# BPT encoder: graph attention backends vs dense SDPA",
        "",
        f"{env['gpu']} ({env['gpu_memory_gib']} GiB), torch {env['torch']}, CUDA {env['cuda']}, "
        f"Python {env['python']}, {env['date']}. {args.layers} layers, d {args.dim}, "
        f"FFN {args.ffn_dim}, {args.heads} heads, {args.tokens} tokens per batch, {args.dtype}, "
        f"forward+backward, mean of {args.iters} steps after {args.warmup} warm-up.",
        "",
        "| n | k | batch | dense ms | " + " | ".join(f"{b} ms | {b} vs dense" for b in graph_backends)
        + " | dense GiB | " + " | ".join(f"{b} GiB | {b} KiB per token per log2 n"
                                        for b in graph_backends) + " |",
        "|---|---|---|---|" + "---|---|" * len(graph_backends) + "---|"
        + "---|---|" * len(graph_backends),
    ]

    def ms(r):
        return "OOM" if r is None else f"{r[0] * 1000:.1f}"

    def gib(r):
        return "OOM" if r is None else f"{r[1]:.2f}"

    def ratio(a, b):
        return "-" if a is None or b is None else f"{a[0] / b[0]:.2f}x"

    for row in results:
        dense = row.get("dense")
        tokens = row["batch"] * row["n"]

        def per_nlogn(r, tokens=tokens, n=row["n"]):  # O(n log n) memory <=> constant bytes per token per log2 n
            return "-" if r is None else f"{r[1] * 2**20 / (tokens * math.log2(n)):.2f}"

        lines.append(f"| {row['n']} | {row['k']} | {row['batch']} | {ms(dense)} | "
                     + " | ".join(f"{ms(row[b])} | {ratio(dense, row[b])}" for b in graph_backends)
                     + f" | {gib(dense)} | "
                     + " | ".join(f"{gib(row[b])} | {per_nlogn(row[b])}" for b in graph_backends)
                     + " |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(results, env, path):
    matplotlib = import_extra("matplotlib", "plots", "the benchmark's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    lengths = sorted({r["n"] for r in results})
    dense = {r["n"]: r["dense"] for r in results}
    for axis, index, label in ((speed, 0, "forward+backward s"), (memory, 1, "peak GiB")):
        xs = [n for n in lengths if dense[n] is not None]
        axis.plot(xs, [dense[n][index] for n in xs], "k-o", label="dense (SDPA)")
        for k in sorted({r["k"] for r in results}):
            for backend, style in (("cuda", "-s"), ("triton", "-D"), ("flex", "--^")):
                rows = [r for r in results if r["k"] == k and r[backend] is not None]
                axis.plot([r["n"] for r in rows], [r[backend][index] for r in rows], style,
                          label=f"{backend} k={k}")
        axis.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel=label)
        axis.grid(True, which="both", alpha=0.3)
    speed.legend(fontsize=7, ncol=2)
    fig.suptitle(f"BPT encoder, {env['gpu']}, torch {env['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--backends", nargs="+", default=["dense", "flex", "cuda", "triton"],
                        choices=["dense", "flex", "cuda", "triton"])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn-dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "cuda_graph_attention")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmark_cuda_graph_attention: needs a CUDA GPU")
    if "cuda" in args.backends:
        try:
            cuda_backend.load_extension(verbose=False)
        except Exception as error:  # no nvcc, or the build failed: measure the others
            print(f"benchmark_cuda_graph_attention: the cuda backend is left out: {error}", flush=True)
            args.backends = [b for b in args.backends if b != "cuda"]
    for name in ("recompile_limit", "cache_size_limit"):  # one flex compilation per shape
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    dtype = getattr(torch, args.dtype)
    env = environment()
    print(json.dumps(env), flush=True)

    results = []
    for n in args.lengths:
        batch = max(1, args.tokens // n)
        dense_result = None
        for k in args.ks:
            started = time.time()
            graph = bpt_graph(n, k)
            print(f"n={n} k={k}: graph {graph.num_nodes} nodes, {graph.num_edges} edges "
                  f"({time.time() - started:.0f} s)", flush=True)
            torch.manual_seed(0)
            model = Encoder(args.layers, args.dim, args.ffn_dim, args.heads,
                            graph.num_edge_types).to("cuda", dtype)
            tokens = torch.randn(batch, n, args.dim, device="cuda", dtype=dtype)
            row = {"n": n, "k": k, "batch": batch, "nodes": graph.num_nodes,
                   "edges": graph.num_edges}
            for backend in args.backends:
                if backend == "dense" and dense_result is not None:
                    row["dense"] = dense_result  # does not depend on k
                    continue
                row[backend] = measure(model, tokens, graph, backend, args.warmup, args.iters)
                print(f"  {backend:6s} " + ("OOM" if row[backend] is None else
                      f"{row[backend][0] * 1000:9.1f} ms  {row[backend][1]:7.2f} GiB"), flush=True)
            dense_result = row.get("dense")
            for backend in ("dense", "flex", "cuda", "triton"):
                row.setdefault(backend, None)
            results.append(row)
            del model, tokens
            torch.cuda.empty_cache()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"environment": env, "settings": {k: str(v) for k, v in vars(args).items()},
         "results": results}, indent=1))
    write_table(results, env, args, args.out.with_suffix(".md"))
    write_plot(results, env, args.out.with_suffix(".png"))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
