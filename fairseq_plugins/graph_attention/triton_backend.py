"""The ``"triton"`` backend of ``graph_attention``: flash attention over the bands of a tree.

Forward: one program per (query block or part of it, sentence x head) walks the block's key
tiles (``tile_plan``) with an online softmax in fp32 and saves the log-sum-exp. Backward,
FA2 style: Delta = rowsum(dO * O); dQ per query block; dK/dV per aligned key block over the
windows of query slots that read it. Parts of split blocks are merged here, in a fixed order.

The relative-key term is a gathered fp32 table scale * q . rel_key[t] ([BH, N, T], one GEMM);
its gradient, summed per (row, type) in the dQ kernel, becomes d rel_key and the rest of dQ
through two GEMMs. dQ, dK and dV use no atomics and are bitwise reproducible; the per-(row,
type) sums use fp32 atomics, so d rel_key may differ in the last bits between runs.

Launch configurations are fixed in ``CONFIGS``, per kernel, dtype and head dim: no
autotuning is possible without a GPU, so they are chosen by the static limits that
``triton_aot`` checks for sm_80 and sm_90a (zero spills, shared memory within the block
limit, tensor-core instructions). fp32 operands are multiplied in tf32x3 (``DOT_PRECISION``),
which needs smaller tiles than fp16/bf16. On CPU the kernels
run under ``TRITON_INTERPRET=1`` (the tests).
"""

import contextlib
import os
from dataclasses import dataclass
from typing import Dict, Tuple

import torch
from torch.autograd.function import once_differentiable

from fairseq_plugins.graph_attention import triton_kernels  # ImportError without Triton
from fairseq_plugins.graph_attention.precision import backward_without_autocast
from fairseq_plugins.graph_attention.registry import register_backend
from fairseq_plugins.graph_attention.tile_plan import TilePlan, merge_forward, merge_sum, plan_on
from fairseq_plugins.graphs.attention_graph import AttentionGraph

HEAD_DIMS = (32, 64, 128)
GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BATCH_HEADS = 65535  # grid.y
MAX_DROPOUT_NODES = 2**16 - 1  # the dropout hash's counter is query * N + key in 32 bits
# tensor-core input precision: fp32 operands are split into a high and a low tf32 part and
# multiplied in three tf32 products (about fp32 accuracy); fp16/bf16 operands are exact
DOT_PRECISION = {torch.float32: "tf32x3", torch.float16: "ieee", torch.bfloat16: "ieee"}


@dataclass(frozen=True)
class LaunchConfig:
    """One compiled binary: the plan's tiles (``block_m`` query rows x ``block_n`` key columns;
    the key kernel runs the transposed tiles), warps and software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# (kernel, head dim) -> configuration, chosen by the limits ``triton_aot`` checks (zero
# spills, shared memory, tensor cores on sm_80 and sm_90a). The three kernels of a dtype and
# head dim share one plan, hence one tile size.
_HALF = {  # fp16 and bf16
    ("forward", 32): LaunchConfig(64, 32, 4, 2),
    ("forward", 64): LaunchConfig(64, 32, 4, 2),
    ("forward", 128): LaunchConfig(64, 32, 8, 2),
    ("backward_query", 32): LaunchConfig(64, 32, 4, 2),
    ("backward_query", 64): LaunchConfig(64, 32, 4, 2),
    ("backward_query", 128): LaunchConfig(64, 32, 8, 2),
    ("backward_key", 32): LaunchConfig(64, 32, 4, 2),
    ("backward_key", 64): LaunchConfig(64, 32, 4, 2),
    ("backward_key", 128): LaunchConfig(64, 32, 8, 2),
}
_FP32 = {  # 4-byte operands, split again by tf32x3: smaller tiles (larger ones spill)
    ("forward", 32): LaunchConfig(64, 16, 4, 2),
    ("forward", 64): LaunchConfig(32, 16, 8, 2),
    ("forward", 128): LaunchConfig(16, 16, 4, 2),
    ("backward_query", 32): LaunchConfig(64, 16, 4, 2),
    ("backward_query", 64): LaunchConfig(32, 16, 8, 1),
    ("backward_query", 128): LaunchConfig(16, 16, 8, 2),
    ("backward_key", 32): LaunchConfig(64, 16, 4, 2),
    ("backward_key", 64): LaunchConfig(32, 16, 4, 1),
    ("backward_key", 128): LaunchConfig(16, 16, 4, 1),
}
# (kernel, dtype, head dim) -> the one configuration launched, each with and without dropout
CONFIGS: Dict[Tuple[str, torch.dtype, int], LaunchConfig] = {
    (kernel, dtype, dim): config
    for dtype, table in ((torch.float32, _FP32), (torch.float16, _HALF), (torch.bfloat16, _HALF))
    for (kernel, dim), config in table.items()}
KERNELS = {"forward": triton_kernels.forward_kernel,
           "backward_query": triton_kernels.backward_query_kernel,
           "backward_key": triton_kernels.backward_key_kernel}


def interpreted() -> bool:
    """Whether Triton runs kernels on the CPU (``TRITON_INTERPRET=1``, read at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def refuses(query: torch.Tensor, graph: AttentionGraph, dropout_p: float = 0.0):
    """Why the kernels cannot run these inputs (None: they can): CUDA tensors (any device
    under the interpreter) of a dtype and head dim in ``CONFIGS``, at most
    ``MAX_BATCH_HEADS`` sentences x heads, a square graph, and with dropout at most
    ``MAX_DROPOUT_NODES`` nodes."""
    if not (query.is_cuda or interpreted()):
        return f"CUDA tensors only (any device with TRITON_INTERPRET=1), got {query.device}"
    if query.dtype not in GPU_DTYPES or query.size(-1) not in HEAD_DIMS:
        return f"dtypes {GPU_DTYPES} and head dims {HEAD_DIMS}, got {query.dtype} / {query.size(-1)}"
    if query.size(0) * query.size(1) > MAX_BATCH_HEADS:
        return f"at most {MAX_BATCH_HEADS} sentences x heads, got {query.size(0) * query.size(1)}"
    if not graph.square:
        return "square graphs only (a decoding step's graph runs on the torch backend)"
    if dropout_p > 0 and graph.num_nodes > MAX_DROPOUT_NODES:
        return (f"dropout hashes (query, key) pairs in 32 bits: at most {MAX_DROPOUT_NODES} "
                f"nodes, got {graph.num_nodes}")
    return None


def tiles(dtype: torch.dtype, head_dim: int) -> Tuple[int, int]:
    """(block_m, block_n) of the plan that every kernel of this dtype and head dim runs."""
    config = CONFIGS[("forward", dtype, head_dim)]
    return config.block_m, config.block_n


def kernel_constants(kernel: str, dtype: torch.dtype, head_dim: int, config: LaunchConfig,
                     dropout: bool, upcast=False) -> dict:
    """The constexpr arguments of a launch (shared with the ahead-of-time compile); the key
    kernel's tiles are the transposed ones (block_m keys x block_n query slots)."""
    rows, cols = config.block_m, config.block_n
    if kernel == "backward_key":
        rows, cols = cols, rows
    return dict(D=head_dim, BLOCK_M=rows, BLOCK_N=cols, PRECISION=DOT_PRECISION[dtype],
                DROPOUT=dropout, UPCAST=upcast)


def device_guard(tensor: torch.Tensor):
    """The tensor's CUDA device made current for a launch: Triton launches on the current
    device, which need not be the tensors' (inputs on cuda:1 in a process on cuda:0)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _launch(name, grid, dtype, head_dim, dropout, *args):
    config = CONFIGS[(name, dtype, head_dim)]
    # the interpreter's bf16 tl.dot is wrong (Triton issue 11584): compute those in fp32
    upcast = interpreted() and dtype == torch.bfloat16
    constants = kernel_constants(name, dtype, head_dim, config, dropout, upcast)
    with device_guard(args[0]):
        KERNELS[name][grid](*args, **constants, num_warps=config.num_warps,
                            num_stages=config.num_stages)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned start: the alignment the binaries are compiled for."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _scalars(rel_table, pad, lse, num_nodes, heads, batch_heads, scale, seed, dropout_p):
    """The trailing kernel arguments shared by the three kernels (without relative keys,
    the table's pointer is lse, never read)."""
    num_types = 1 if rel_table is None else rel_table.size(-1)
    return (lse if rel_table is None else rel_table, pad, num_nodes, num_types, heads,
            batch_heads, float(scale), seed, int(round(dropout_p * 2**24)),
            1.0 / (1.0 - dropout_p), int(rel_table is not None))


class TritonGraphAttention(torch.autograd.Function):
    """Forward and FA2-style backward through the kernels of ``triton_kernels``."""

    @staticmethod
    def forward(ctx, query, key, value, rel_key, key_padding_mask, plan: TilePlan, scale,
                dropout_p):
        bsz, heads, num_nodes, dim = query.shape
        bh = bsz * heads
        q, k, v = (_aligned(x.reshape(bh, num_nodes, dim)) for x in (query, key, value))
        device = q.device
        rel_table = None
        if rel_key is not None:  # scale * q . rel_key[t] for every row and type
            rel_table = _aligned((q.float() @ rel_key.float().t()).mul_(scale))
        if key_padding_mask is None:  # one binary for both: a mask with every key present
            pad = torch.zeros(bsz, num_nodes, device=device, dtype=torch.uint8)
        else:
            pad = _aligned(key_padding_mask.to(device=device, dtype=torch.uint8))
        # the dropout seed comes from torch's generator: torch.manual_seed reproduces it
        seed = int(torch.randint(0, 2**31 - 1, ()).item()) if dropout_p > 0 else 0
        out = torch.empty_like(q)
        lse = torch.empty(bh, num_nodes, device=device)
        work = plan.query_work
        part_out = torch.empty(work.num_parts, bh, plan.block_m, dim, device=device)
        part_lse = torch.empty(work.num_parts, bh, plan.block_m, device=device)
        scalars = _scalars(rel_table, pad, lse, num_nodes, heads, bh, scale, seed, dropout_p)
        _launch("forward", (work.items.size(0), bh), q.dtype, dim, dropout_p > 0,
                q, k, v, out, lse, part_out, part_lse, plan.slot_node, work.items,
                plan.tile_start, plan.tile_types, *scalars)
        merge_forward(out, lse, part_out, part_lse, plan)
        ctx.save_for_backward(q, k, v, out, lse, rel_key, rel_table, pad)
        ctx.plan, ctx.scale, ctx.dropout_p, ctx.seed = plan, scale, dropout_p, seed
        ctx.shape = query.shape
        return out.view(query.shape)

    @staticmethod
    @backward_without_autocast
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, rel_key, rel_table, pad = ctx.saved_tensors
        plan = ctx.plan
        bsz, heads, num_nodes, dim = ctx.shape
        bh, device = bsz * heads, q.device
        grad_out = _aligned(grad_out.reshape(bh, num_nodes, dim))
        delta = (grad_out.float() * out.float()).sum(-1)
        scalars = _scalars(rel_table, pad, lse, num_nodes, heads, bh, ctx.scale, ctx.seed,
                           ctx.dropout_p)

        work = plan.query_work
        grad_q = torch.empty(bh, num_nodes, dim, device=device)
        part_grad_q = torch.empty(work.num_parts, bh, plan.block_m, dim, device=device)
        grad_rows = lse if rel_table is None else torch.zeros_like(rel_table)
        _launch("backward_query", (work.items.size(0), bh), q.dtype, dim, ctx.dropout_p > 0,
                q, k, v, grad_out, lse, delta, grad_q, part_grad_q, grad_rows, plan.slot_node,
                work.items, plan.tile_start, plan.tile_types, *scalars)
        merge_sum(grad_q, part_grad_q, plan, work, True)

        work = plan.key_work
        grad_k, grad_v = (torch.empty(bh, num_nodes, dim, device=device) for _ in range(2))
        part_grad_k, part_grad_v = (torch.empty(work.num_parts, bh, plan.block_m, dim,
                                                device=device) for _ in range(2))
        _launch("backward_key", (work.items.size(0), bh), q.dtype, dim, ctx.dropout_p > 0,
                q, k, v, grad_out, lse, delta, grad_k, grad_v, part_grad_k, part_grad_v,
                plan.slot_node, plan.slot_node.numel(), work.items, plan.window_start,
                plan.window_types, *scalars)
        merge_sum(grad_k, part_grad_k, plan, work, False)
        merge_sum(grad_v, part_grad_v, plan, work, False)

        grad_rel = None
        if rel_table is not None:  # d(score) summed per (row, type): the relative-key terms
            grad_rows.mul_(ctx.scale)
            grad_q += grad_rows @ rel_key.float()
            grad_rel = (grad_rows.reshape(-1, grad_rows.size(-1)).t()
                        @ q.reshape(-1, dim).float()).to(rel_key.dtype)
        shape, dtype = ctx.shape, q.dtype
        return (grad_q.to(dtype).view(shape), grad_k.to(dtype).view(shape),
                grad_v.to(dtype).view(shape), grad_rel, None, None, None, None)


def triton_graph_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                           dropout_p=0.0, scale=None):
    """Backend function (see ``graph_attention`` for the semantics)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    reason = refuses(query, graph, dropout_p)
    if reason is not None:
        raise ValueError(f"the triton graph attention backend: {reason}")
    if scale is None:
        scale = query.size(-1) ** -0.5
    if graph.num_edges == 0:  # no row has a key
        return torch.zeros_like(query)
    plan = plan_on(graph, *tiles(query.dtype, query.size(-1)), query.device)
    return TritonGraphAttention.apply(query, key, value, rel_key, key_padding_mask, plan,
                                      float(scale), float(dropout_p))


def prepare(query: torch.Tensor, graph: AttentionGraph) -> None:
    """The graph's tile plan for this dtype and head dim, on the query's device."""
    if graph.num_edges:  # (an edgeless graph needs none: its output is zeros)
        plan_on(graph, *tiles(query.dtype, query.size(-1)), query.device)


register_backend("triton", triton_graph_attention, refuses, prepare)
