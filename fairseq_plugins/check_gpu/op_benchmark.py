"""The graph attention op on one device against dense and block-sparse attention, per op.

    python -m fairseq_plugins.check_gpu.op_benchmark --out op.json [--lengths ...] [--ks ...]

For every BPT graph (n tokens, k) and attention dropout off and on, each candidate runs one
multi-head attention over a batch of ``--tokens`` tokens (``--heads`` x ``--head-dim``):

* the graph backends (``triton``, ``cuda``, ``flex``: FlexAttention with the graph's block
  mask, ``torch``) over the graph's nodes, through ``graph_attention``;
* ``sdpa``: dense ``scaled_dot_product_attention`` over the n tokens, pinned to
  FlashAttention on CUDA (the transformer's attention).

Measured in the same run: forward and backward times separately (median of ``--iters``
after ``--warmup``), the peak memory, a profiler split of each phase into the attention
kernels and the glue around them (PyTorch's own kernels: copies, fills, reductions,
elementwise; with the number of launches and the host's wall time), and, with dropout off,
the error of the output and every gradient against float64 (one sentence, two heads: the
torch backend, or the math SDPA, in float64 on the same device). The JSON is rewritten after
every row, so a run stopped by a timeout keeps every row it measured.
"""

import argparse
import json
import re
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from fairseq_plugins.check_gpu.kernel_checks import errors_against_float64, relative_errors
from fairseq_plugins.check_gpu.runner import PROGRESS, format_duration
from fairseq_plugins.command_line import command_parser
from fairseq_plugins.graph_attention import graph_attention
from fairseq_plugins.graph_attention.registry import AUTO_CANDIDATES
from fairseq_plugins.graphs.binary_partition import bpt_graph

GRAPH_BACKENDS = AUTO_CANDIDATES
# kernels PyTorch launches around an attention kernel (CUDA names, and ATen ops on the CPU);
# every other kernel is counted as the attention's own
GLUE = re.compile(r"at::native|at::|cub::|cutlass::Kernel.*gemm|gemm|Memcpy|Memset|"
                  r"elementwise|reduce_kernel|triton_(poi|red|per)_|^aten::", re.IGNORECASE)


def sdpa_context(device):
    """FlashAttention for the dense baseline on CUDA; SDPA's own choice elsewhere."""
    if torch.device(device).type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def attention(backend: str, graph, dropout_p: float, device) -> Callable:
    if backend == "sdpa":
        def dense(q, k, v, rel_key):
            with sdpa_context(device):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        return dense
    return lambda q, k, v, rel_key: graph_attention(q, k, v, graph, rel_key, None, dropout_p,
                                                    backend=backend)


def make_leaves(nodes: int, batch: int, heads: int, dim: int, types: int, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    leaves = [torch.randn(batch, heads, nodes, dim, generator=gen, device=device, dtype=dtype)
              for _ in range(3)]
    leaves.append(0.5 * torch.randn(types, dim, generator=gen, device=device, dtype=dtype))
    return [t.requires_grad_() for t in leaves]


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_phases(fn, leaves, grad, device, warmup: int, iters: int) -> Dict[str, float]:
    """Median forward and backward milliseconds (the backward of the forward just timed)."""
    def step():
        out = fn(*leaves)
        synchronize(device)
        middle = time.perf_counter()
        out.backward(grad)
        synchronize(device)
        for t in leaves:
            t.grad = None
        return middle

    for _ in range(warmup):
        step()
    forward, backward = [], []
    for _ in range(iters):
        synchronize(device)
        start = time.perf_counter()
        middle = step()
        end = time.perf_counter()
        forward.append(1e3 * (middle - start))
        backward.append(1e3 * (end - middle))
    return {"forward_ms": statistics.median(forward), "backward_ms": statistics.median(backward)}


def _wrapper(name: str) -> bool:
    """Host-side frames around ops (the autograd engine, profiler records), not ops."""
    return name.startswith(("autograd::", "torch::autograd::", "ProfilerStep", "[memory]"))


def _outermost_op(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if not _wrapper(parent.name):
            return False
        parent = parent.cpu_parent
    return not _wrapper(event.name)


def split(events, on_cuda: bool, wall_ms: float) -> Dict[str, float]:
    """Attention kernels vs glue among one phase's CUDA kernels (on the CPU: its outermost
    ops, ATen ones being glue), with their count and the phase's wall time."""
    if on_cuda:
        kernels = [(e.name, e.time_range.elapsed_us() / 1e3) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        kernels = [(e.name, e.cpu_time_total / 1e3) for e in events if _outermost_op(e)]
    glue = [ms for name, ms in kernels if GLUE.search(name)]
    own = [ms for name, ms in kernels if not GLUE.search(name)]
    return {"launches": len(kernels), "attention_kernels": len(own), "attention_ms": sum(own),
            "glue_kernels": len(glue), "glue_ms": sum(glue), "wall_ms": wall_ms}


def profile_phases(fn, leaves, grad, device) -> Dict[str, Dict[str, float]]:
    """One profiled forward and, separately, its backward."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities):  # the profiler's own first-use cost, not measured
        fn(*leaves).backward(grad)
    phases = {}
    out = None
    for phase in ("forward", "backward"):
        synchronize(device)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            if phase == "forward":
                out = fn(*leaves)
            else:
                out.backward(grad)
            synchronize(device)
        phases[phase] = split(prof.events(), on_cuda, 1e3 * (time.perf_counter() - start))
    for t in leaves:
        t.grad = None
    return phases


def dense_errors(dtype, dim: int, n: int, device) -> Dict[str, float]:
    """SDPA in ``dtype`` against the math SDPA in float64 (one sentence, two heads)."""
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, 2, n, dim, generator=gen).to(dtype).double() for _ in range(3)]
    grad = torch.randn(1, 2, n, dim, generator=gen).to(dtype).double()

    def run(run_dtype, context):
        tensors = [t.to(device, run_dtype).requires_grad_() for t in leaves]
        with context:
            out = F.scaled_dot_product_attention(*tensors)
        return [out.detach()] + list(torch.autograd.grad(out, tensors, grad.to(device, run_dtype)))

    expected = [t.cpu() for t in run(torch.float64, nullcontext())]
    return relative_errors(run(dtype, sdpa_context(device)), expected)


def measure(backend: str, graph, n: int, dropout_p: float, args) -> Dict:
    """One candidate on one graph: times, memory, profiler split, error; or why not."""
    dtype = getattr(torch, args.dtype)
    batch = max(1, args.tokens // n)
    nodes = n if backend == "sdpa" else graph.num_nodes
    row = {"backend": backend, "dropout": dropout_p}
    try:
        leaves = make_leaves(nodes, batch, args.heads, args.head_dim, graph.num_edge_types, dtype,
                             args.device)
        grad = torch.randn_like(leaves[0])
        fn = attention(backend, graph, dropout_p, args.device)
        if torch.device(args.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)
        row.update(time_phases(fn, leaves, grad, args.device, args.warmup, args.iters))
        row["total_ms"] = row["forward_ms"] + row["backward_ms"]
        if torch.device(args.device).type == "cuda":
            row["peak_mib"] = torch.cuda.max_memory_allocated(args.device) / 2**20
        row["profile"] = profile_phases(fn, leaves, grad, args.device)
        del leaves, grad
        if dropout_p == 0:
            if backend == "sdpa":
                row["errors"] = dense_errors(dtype, args.head_dim, n, args.device)
            else:
                errors, wrong = errors_against_float64(
                    backend, graph, [n], dtype, args.head_dim, args.device,
                    reference_device=args.device)
                row["errors"] = errors
                if wrong:
                    row["wrong_outputs"] = wrong
        row["status"] = "ok"
    except torch.cuda.OutOfMemoryError:
        row["status"] = "out of memory"
    except (RuntimeError, ValueError, NotImplementedError) as error:
        row["status"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return row


def environment(device) -> Dict[str, str]:
    env = {"torch": torch.__version__, "device": str(device)}
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = str(torch.version.cuda)
    return env


def run(args) -> Dict:
    cases = [(n, k) for n in args.lengths for k in args.ks]
    result = {"settings": {key: value for key, value in vars(args).items() if key != "out"},
              "environment": environment(args.device), "cases": []}
    start = time.time()
    for index, (n, k) in enumerate(cases):
        graph = bpt_graph(n, k)
        case = {"n": n, "k": k, "batch": max(1, args.tokens // n), "nodes": graph.num_nodes,
                "edges": graph.num_edges, "rows": []}
        result["cases"].append(case)
        for dropout_p in args.dropout:
            for backend in args.backends:
                case["rows"].append(measure(backend, graph, n, dropout_p, args))
                args.out.write_text(json.dumps(result, indent=1) + "\n")
        done = time.time() - start
        left = done / (index + 1) * (len(cases) - index - 1)
        print(f"{PROGRESS} case {index + 1}/{len(cases)} (n {n}, k {k}) done; the benchmark has "
              f"about {format_duration(left)} left", flush=True)
    return result


def format_ms(row, key) -> str:
    """``row[key]`` in ms with three decimals, or '-' when it was not measured."""
    return f"{row[key]:.3f}" if key in row else "-"


def markdown(result: Dict) -> str:
    """Times and errors per case, then the profiler split; ratios against SDPA of the same
    n and dropout."""
    s = result["settings"]
    lines = [f"{s['heads']} heads x {s['head_dim']}, {s['tokens']} tokens per batch, "
             f"{s['dtype']}, on {result['environment'].get('gpu', s['device'])}; median of "
             f"{s['iters']} after {s['warmup']} warm-up. `sdpa`: dense attention over the n "
             "tokens (FlashAttention on CUDA); the graph backends attend over the graph's nodes. "
             "Error: max |x - float64| / max(max |float64|, 1) over the output and all gradients.",
             "", "| n | k | backend | dropout | forward ms | backward ms | total ms | SDPA / this "
             "| peak MiB | error vs float64 | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    split_lines = ["| n | k | backend | dropout | phase | launches | attention kernels | "
                   "attention ms | glue kernels | glue ms | wall ms |",
                   "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in result["cases"]:
        dense = {row["dropout"]: row for row in case["rows"] if row["backend"] == "sdpa"}
        for row in case["rows"]:
            base = dense.get(row["dropout"], {})
            ratio = (f"{base['total_ms'] / row['total_ms']:.2f}x"
                     if "total_ms" in row and "total_ms" in base else "-")
            error = f"{max(row['errors'].values()):.2e}" if "errors" in row else "-"
            peak = f"{row['peak_mib']:.0f}" if "peak_mib" in row else "-"
            lines.append(f"| {case['n']} | {case['k']} | {row['backend']} | {row['dropout']} | "
                         f"{format_ms(row, 'forward_ms')} | {format_ms(row, 'backward_ms')} | "
                         f"{format_ms(row, 'total_ms')} | {ratio} | {peak} | {error} | "
                         f"{row['status'].replace('|', '/')} |")
            for phase, p in row.get("profile", {}).items():
                split_lines.append(
                    f"| {case['n']} | {case['k']} | {row['backend']} | {row['dropout']} | {phase} | "
                    f"{p['launches']} | {p['attention_kernels']} | {p['attention_ms']:.3f} | "
                    f"{p['glue_kernels']} | {p['glue_ms']:.3f} | {p['wall_ms']:.3f} |")
    return "\n".join(lines + ["", "Profiler split (one profiled call per phase):", ""] + split_lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = command_parser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON written after every row")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                   help="sequence lengths (default: %(default)s)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64],
                   help="BPT's k values (default: %(default)s)")
    p.add_argument("--backends", nargs="+", default=["sdpa", *GRAPH_BACKENDS],
                   choices=["sdpa", *GRAPH_BACKENDS], help="graph-attention backends, and sdpa as the dense "
                   "reference (default: all)")
    p.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1],
                   help="attention dropout values (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per batch")
    p.add_argument("--heads", type=int, default=8,
                   help="attention heads (default: %(default)s)")
    p.add_argument("--head-dim", type=int, default=64,
                   help="dimension per head (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"],
                   help="data type (default: %(default)s)")
    p.add_argument("--device", default="cuda",
                   help="torch device (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed calls before timing (default: %(default)s)")
    p.add_argument("--iters", type=int, default=10,
                   help="timed calls per case (default: %(default)s)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = run(args)
    args.out.with_suffix(".md").write_text(markdown(result))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
