"""The check's first answer (``check_gpu --benchmark headline``): the graph attention at the
length BPT is for, against dense attention and block-sparse attention.

    python -m fairseq_plugins.check_gpu.headline --backend triton --out headline.json [--device cuda]

One backend per process (the command runs them one after another, before the tests), so a
crash or a hung kernel loses only its own row: a BPT graph of n 8192 tokens, k 4, bf16, 8
heads x 64, one sentence, forward + backward, no dropout, timed, profiled and checked
against float64 as ``op_benchmark.measure`` does. ``sdpa`` is dense attention over the n
tokens pinned to FlashAttention; ``flex`` is FlexAttention with the graph's block mask. The
row is added to ``--out`` as soon as it is measured (the file rewritten through a temporary
one, an earlier row of the same backend replaced); a backend that refuses these inputs here
gets a row with its reason. ``markdown`` gives every backend's speed-up over SDPA and over
flex, on wall-clock time and on GPU-kernel time (the CUDA kernels' time from
torch.profiler; on a CPU run, the ops' CPU time).
"""

import argparse
import json
import os
from pathlib import Path
from typing import Dict, List, Optional

import torch

from fairseq_plugins.command_line import command_parser
from fairseq_plugins.check_gpu.op_benchmark import environment, format_ms, measure
from fairseq_plugins.graph_attention.registry import AUTO_CANDIDATES, DEFAULT
from fairseq_plugins.graphs.binary_partition import bpt_graph

DENSE, BLOCK_SPARSE = "sdpa", "flex"  # the two baselines every row is compared with
# the baselines first (their rows are there even when a later backend hangs), then the
# fast graph backends; not the torch reference, which is no contender at this length
BACKENDS = (DENSE, BLOCK_SPARSE, *(name for name in AUTO_CANDIDATES if name not in (BLOCK_SPARSE, "torch")))


def kernel_ms(row: Dict) -> Optional[float]:
    """Forward + backward time inside kernels (attention and glue), from the profiler."""
    phases = row.get("profile", {}).values()
    return sum(p["attention_ms"] + p["glue_ms"] for p in phases) if phases else None


def measure_row(args) -> Dict:
    """``args.backend``'s row: measured, or refused with the reason."""
    graph = bpt_graph(args.n, args.k)
    if args.backend != DENSE:
        query = torch.empty((), dtype=getattr(torch, args.dtype), device=args.device).expand(
            1, args.heads, graph.num_nodes, args.head_dim)
        reason = DEFAULT.refuses(args.backend, query, graph, 0.0)
        if reason is not None:
            return {"backend": args.backend, "status": f"refused: {reason}"}
    row = measure(args.backend, graph, args.n, 0.0, args)
    row.pop("dropout")
    if "total_ms" in row:
        row["kernel_ms"] = kernel_ms(row)
    return row


def add_row(path: Path, settings: Dict, row: Dict, device) -> None:
    """Add ``row`` to the JSON at ``path`` (made with ``settings`` when missing), replacing
    the backend's earlier row; written to a temporary file renamed over it."""
    data = {"settings": settings, "environment": environment(device), "rows": []}
    if path.exists():
        data = json.loads(path.read_text())
        if data["settings"] != settings:
            raise SystemExit(f"headline: {path} holds rows of other settings ({data['settings']}); "
                             "use another --out or delete it")
    data["rows"] = [r for r in data["rows"] if r["backend"] != row["backend"]] + [row]
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(temporary, path)


def _speedup(base: Optional[float], this: Optional[float]) -> str:
    return f"{base / this:.2f}x" if base and this else "-"


def markdown(result: Dict) -> str:
    """One line per backend: times, speed-ups over SDPA and flex (base time / this time) on
    wall-clock and kernel time, the error against float64, the status."""
    s = result["settings"]
    rows = {row["backend"]: row for row in result["rows"]}
    on_gpu = torch.device(s["device"]).type == "cuda"
    kernels = "GPU-kernel" if on_gpu else "CPU op (no GPU)"
    lines = [f"n {s['n']}, k {s['k']}, {s['dtype']}, {s['heads']} heads x {s['head_dim']}, one sentence, "
             f"forward + backward, on {result['environment'].get('gpu', s['device'])}; median of {s['iters']} "
             f"after {s['warmup']} warm-up; {kernels} time from torch.profiler. `sdpa`: dense attention "
             "over the n tokens (FlashAttention on CUDA); `flex`: FlexAttention with the graph's block mask. "
             "Speed-up: the baseline's time / this backend's time.", "",
             f"| backend | forward ms | backward ms | total ms | vs SDPA (wall) | vs flex (wall) | {kernels} ms "
             "| vs SDPA (kernels) | vs flex (kernels) | error vs float64 | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    dense, sparse = rows.get(DENSE, {}), rows.get(BLOCK_SPARSE, {})
    for row in result["rows"]:
        error = f"{max(row['errors'].values()):.2e}" if "errors" in row else "-"
        lines.append(
            f"| {row['backend']} | {format_ms(row, 'forward_ms')} | {format_ms(row, 'backward_ms')} | "
            f"{format_ms(row, 'total_ms')} | "
            f"{_speedup(dense.get('total_ms'), row.get('total_ms'))} | "
            f"{_speedup(sparse.get('total_ms'), row.get('total_ms'))} | {format_ms(row, 'kernel_ms')} | "
            f"{_speedup(dense.get('kernel_ms'), row.get('kernel_ms'))} | "
            f"{_speedup(sparse.get('kernel_ms'), row.get('kernel_ms'))} | {error} | "
            f"{row['status'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = command_parser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, choices=BACKENDS, help="the one backend this process measures")
    p.add_argument("--out", type=Path, required=True, help="the JSON the row is added to")
    p.add_argument("--device", default="cuda", help="the device to measure on (cpu: a dry run)")
    p.add_argument("--n", type=int, default=8192, help="tokens of the sentence")
    p.add_argument("--k", type=int, default=4, help="BPT's k")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--head-dim", type=int, default=64, help="the dimension of a head")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"],
                   help="the dtype of q, k and v")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--iters", type=int, default=10, help="timed rounds")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Measure one backend and add its row; exit 0 once the row is written (its status says
    whether the backend ran: a measurement, not a test)."""
    args = parser().parse_args(argv)
    args.tokens = args.n  # one sentence (``measure``'s batch is tokens // n)
    settings = {key: value for key, value in vars(args).items() if key not in ("backend", "out")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    row = measure_row(args)
    add_row(args.out, settings, row, args.device)
    print(f"headline: {args.backend}: {row['status']}"
          + (f", {row['total_ms']:.3f} ms forward + backward" if "total_ms" in row else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
