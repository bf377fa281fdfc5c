"""The ``"triton"`` backend of ``graph_attention``: flash attention over the bands of a tree.

Forward: one program per (query block or part of it, sentence x head) walks the block's key
tiles (``tile_plan``) with an online softmax in fp32 and saves the log-sum-exp. Backward,
FA2 style: dQ per query block (its kernel also writes Delta = rowsum(dO * O)); dK/dV, in the
input dtype, per aligned key block over the windows of query slots that read it. Parts of
split blocks are merged by three small kernels (forward, dQ, dK with dV), in the plan's
order. q, k, v, dO and the outputs are [B, H, N, D] tensors read and written through their
strides: the time-first views fairseq's attention hands over go in without a copy, and come
back time-first.
Forward and backward are ``torch.library`` ops over the plan's tensors (``forward_op``,
``backward_op``) with fake implementations, so ``torch.compile`` traces them; the dropout
seed is a tensor on the query's device (``registry.dropout_seed``), never read on the host.

The kernels score in base 2 (``exp2``): the relative-key term is a gathered fp32 table
scale * log2(e) * q . rel_key[t] ([BH, N, T], made by a kernel of ``triton_rel_kernels``).
The dQ kernel sums d(score) per (row, type) by the tile's edge types, in the plan's order,
and adds dQ's relative-key term in fp32 before dQ's one rounding (fp32 and head dim 128:
the sums in a launch of their own first, ``splits_rel_sums``; fp32 dQ gets the term after
the kernels); two more kernels turn the sums into d rel_key in a fixed order. No kernel
uses atomics: dQ, dK, dV and d rel_key are the same bits on every run. Around the kernels
a forward + backward runs the sums' zeros and, with a half-precision rel_key, its fp32 copy
(forward and backward) and the cast of its gradient: at most four PyTorch ops; fp32 adds
the term's GEMM and its addition (three with an fp32 rel_key).

Launch configurations are fixed in ``CONFIGS``, per kernel, dtype and head dim: no
autotuning is possible without a GPU, so they are chosen by the static limits that
``triton_aot`` checks for sm_80 and sm_90a (zero spills, shared memory within the block
limit, tensor-core instructions). fp32 operands are multiplied in tf32x3 (``DOT_PRECISION``),
which needs smaller tiles than fp16/bf16. On CPU the kernels
run under ``TRITON_INTERPRET=1`` (the tests).
"""

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import triton
from torch import Tensor

from fairseq_plugins.graph_attention import triton_kernels, triton_rel_kernels  # ImportError without Triton
from fairseq_plugins.graph_attention.precision import autocast_off
from fairseq_plugins.graph_attention.registry import Backend, release
from fairseq_plugins.graph_attention.tile_plan import TilePlan, WorkItems, plan_on
from fairseq_plugins.graphs.attention_graph import AttentionGraph

HEAD_DIMS = (32, 64, 128)
GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BATCH_HEADS = 65535  # grid.y
MAX_DROPOUT_NODES = 2**16 - 1  # the dropout hash's counter is query * N + key in 32 bits
# tensor-core input precision: fp32 operands are split into a high and a low tf32 part and
# multiplied in three tf32 products (about fp32 accuracy); fp16/bf16 operands are exact
DOT_PRECISION = {torch.float32: "tf32x3", torch.float16: "ieee", torch.bfloat16: "ieee"}


def splits_rel_sums(dtype: torch.dtype, head_dim: int, triton_version: Optional[str] = None) -> bool:
    """Whether the per-(row, type) sums of the dQ kernel run in a launch of their own
    (``backward_query_rel_sums``, no dQ) before the dQ launch, under Triton ``triton_version``
    (default: the installed one): where one binary doing both spills, fp32 (at head dims 64
    and 128; fp32 dQ is never rounded, so its relative-key term can follow the kernels),
    head dim 128 (fp16/bf16 with dropout under Triton 3.6 on sm_90a) and, under Triton 3.6,
    head dim 64 (8-24 B on sm_80 and sm_90a). fp16/bf16 dQ then adds the term from the
    complete sums after its tile loop (split blocks' rows: the dQ merge), in fp32 before its
    one rounding."""
    import triton

    old_triton = release(triton_version or triton.__version__) < (3, 7)
    return dtype == torch.float32 or head_dim == 128 or (head_dim == 64 and old_triton)


@dataclass(frozen=True)
class LaunchConfig:
    """One compiled binary: the plan's tiles (``block_m`` query rows x ``block_n`` key columns;
    the key kernel runs the transposed tiles), warps and software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    max_registers: Optional[int] = None  # ptxas's registers a thread at most (maxnreg); None: its own 255


# (kernel, head dim) -> configuration, chosen by the limits ``triton_aot`` checks (zero
# spills, shared memory, tensor cores on sm_80 and sm_90a). The three kernels of a dtype and
# head dim share one plan, hence one tile size.
_HALF = {  # fp16 and bf16
    # 8 warps: at 4, ptxas holds the sm_80 binary to 128 registers and spills
    ("forward", 32): LaunchConfig(64, 32, 8, 2),
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
# The binaries that ptxas, left to itself, gives more than 240 registers a thread
# (``triton_aot``'s budget, its MAX_REGISTERS) under some checked Triton (3.6.0 above all:
# up to 255) are compiled with at most 240 (``max_registers``): so they keep their warps,
# stages and blocks per SM (4 warps x 240 registers: 2 blocks), where 8 warps or one stage
# fit some of them without the cap only at one block per SM or with unpipelined loads. Only
# those: a cap is also a target, ptxas then uses up to it (the sm_90a bf16 forward at head
# dim 64 took 204 registers under it against 149 without, one block per SM fewer).
REGISTER_CAP = 240
_HALF_CAPPED = {("backward_query", 32), ("backward_query", 64), ("backward_query", 128), ("backward_key", 64),
                ("backward_key", 128)}
_FP32_CAPPED = {("backward_query", 64), ("backward_query", 128), ("backward_key", 64), ("backward_key", 128)}
# and on sm_80 also these
_SM80_CAPPED = {(torch.float16, "forward", 64), (torch.bfloat16, "forward", 64), (torch.float16, "forward", 128),
                (torch.bfloat16, "forward", 128), (torch.float16, "backward_key", 32),
                (torch.bfloat16, "backward_key", 32), (torch.float32, "backward_query", 32),
                (torch.float32, "backward_key", 32)}
# the merges of split blocks: the plan's block (their BLOCK_M), no pipelining (a handful of
# parts, no products), a warp per 1024 elements of their fp32 [block_m, D] sums (32
# registers a thread), at least 4 (head dim 128 on 4 warps spills on sm_90a)
MERGE_KERNELS = ("merge_forward", "merge_grad_q", "merge_grad_kv")


def merge_warps(block_m: int, head_dim: int) -> int:
    return max(4, block_m * head_dim // 1024)


# the relative-key kernels (``triton_rel_kernels``), fp32 products whatever the dtype:
# the table's (block_m rows x block_n types per step), d rel_key's partial sums (block_m
# types x block_n rows per step, ``REL_CHUNK_STEPS`` steps a chunk) and their sum (block_m
# types), no pipelining (one product a step, little to prefetch)
REL_KERNELS = ("rel_table", "rel_grad_partial", "rel_grad_sum")
REL_CONFIGS = {"rel_table": LaunchConfig(64, 16, 4, 1), "rel_grad_partial": LaunchConfig(16, 64, 4, 1),
               "rel_grad_sum": LaunchConfig(16, 16, 4, 1)}
REL_CHUNK_STEPS = 16  # a chunk of d rel_key's partial sums: 16 x 64 rows


# (kernel, dtype, head dim) -> the one configuration launched, the three tile kernels each
# with and without dropout
CONFIGS: Dict[Tuple[str, torch.dtype, int], LaunchConfig] = {
    (kernel, dtype, dim): dataclasses.replace(config, max_registers=REGISTER_CAP if (kernel, dim) in capped else None)
    for dtype, table, capped in ((torch.float32, _FP32, _FP32_CAPPED), (torch.float16, _HALF, _HALF_CAPPED),
                                 (torch.bfloat16, _HALF, _HALF_CAPPED))
    for (kernel, dim), config in table.items()}
CONFIGS.update({(merge, dtype, dim): LaunchConfig(config.block_m, config.block_n,
                                                  merge_warps(config.block_m, dim), 1)
                for (kernel, dtype, dim), config in list(CONFIGS.items()) if kernel == "forward"
                for merge in MERGE_KERNELS})


def _with_rel_sums(table, triton_version: Optional[str] = None):
    """``table`` with the dQ kernel's launch of the sums alone where they have one
    (``splits_rel_sums`` under that Triton), configured as the dQ launch (its tiles, warps,
    stages, cap)."""
    return {**table, **{("backward_query_rel_sums", dtype, dim): config
                        for (kernel, dtype, dim), config in table.items()
                        if kernel == "backward_query" and splits_rel_sums(dtype, dim, triton_version)}}


CONFIGS = _with_rel_sums(CONFIGS)
CONFIGS.update({(kernel, dtype, dim): config for kernel, config in REL_CONFIGS.items()
                for dtype in (GPU_DTYPES if kernel != "rel_grad_sum" else (torch.float32,))  # (fp32 tensors only)
                for dim in HEAD_DIMS})
# capability -> the launches that differ there from ``CONFIGS`` (the sm_90a table), so that
# every binary meets the budget of ``triton_aot`` (at most 240 registers, no spills) under
# every Triton that ``triton_budget`` checks; the tiles stay those of ``CONFIGS`` (one plan
# per dtype and head dim)
ARCH_CHANGES: Dict[int, Dict[Tuple[str, torch.dtype, int], LaunchConfig]] = {
    80: {**{(kernel, dtype, dim): dataclasses.replace(CONFIGS[(kernel, dtype, dim)], max_registers=REGISTER_CAP)
            for dtype, kernel, dim in _SM80_CAPPED},
         # capped on one stage it spills under Triton 3.6.0 (32-36 B); on two, or on 8 warps
         # (one block per SM), not
         ("backward_key", torch.float32, 128): LaunchConfig(16, 16, 4, 2, REGISTER_CAP),
         # capped on two stages, dQ with relative keys, padding and dropout spills 12 B under
         # Triton 3.7.1, dK/dV without them 32 B under 3.6.0; on one stage both keep 2
         # blocks per SM (8 warps: one, and dK/dV over 240 registers with them)
         **{(kernel, dtype, 64): LaunchConfig(64, 32, 4, 1, REGISTER_CAP)
            for kernel in ("backward_query", "backward_key") for dtype in (torch.float16, torch.bfloat16)}}}


# Triton (major, minor) -> the launches that differ, on every target, under that release and
# later ones: where its compiler spills in the table's configuration. Only those binaries
# change, so the others keep what every earlier Triton was checked with.
TRITON_CHANGES: Dict[Tuple[int, int], Dict[Tuple[str, torch.dtype, int], LaunchConfig]] = {
    (3, 8): {
        # uncapped, ptxas keeps it to 168 registers (3 blocks per SM) and spills 8-24 B; capped
        # at 240 it takes 178-190 without spills (2 blocks per SM, those of Triton 3.7)
        ("forward", torch.float32, 128): dataclasses.replace(CONFIGS[("forward", torch.float32, 128)],
                                                             max_registers=REGISTER_CAP),
        # at the cap on two stages it spills 4-24 B; one stage (unpipelined loads) fits
        ("backward_query", torch.float32, 128): dataclasses.replace(CONFIGS[("backward_query", torch.float32, 128)],
                                                                    num_stages=1)}}


@functools.lru_cache(maxsize=None)
def launch_table(capability: Optional[int] = None,
                 triton_version: Optional[str] = None) -> Dict[Tuple[str, torch.dtype, int], LaunchConfig]:
    """The configurations launched on a GPU of ``capability`` (major * 10 + minor) by Triton
    ``triton_version`` (default: the installed one): sm_8x runs the sm_80 table, sm_90 and
    newer and the interpreter (None) ``CONFIGS``, each with the changes of
    ``TRITON_CHANGES`` up to that Triton."""
    import triton

    triton_release = release(triton_version or triton.__version__)
    changes = [ARCH_CHANGES[80]] if capability is not None and capability < 90 else []
    changes += [table for since, table in sorted(TRITON_CHANGES.items()) if triton_release >= since]
    table = {key: config for table in (CONFIGS, *changes) for key, config in table.items()}
    table = _with_rel_sums({key: config for key, config in table.items() if key[0] != "backward_query_rel_sums"},
                           triton_version)
    return CONFIGS if table == CONFIGS else table


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


KERNELS = {"rel_table": triton_rel_kernels.rel_table_kernel,
           "backward_query_rel_sums": triton_kernels.backward_query_kernel,
           "rel_grad_partial": triton_rel_kernels.rel_grad_partial_kernel,
           "rel_grad_sum": triton_rel_kernels.rel_grad_sum_kernel,
           "forward": triton_kernels.forward_kernel,
           "backward_query": triton_kernels.backward_query_kernel,
           "backward_key": triton_kernels.backward_key_kernel,
           "merge_forward": triton_kernels.merge_forward_kernel,
           "merge_grad_q": triton_kernels.merge_grad_q_kernel,
           "merge_grad_kv": triton_kernels.merge_grad_kv_kernel}


def interpreted() -> bool:
    """Whether Triton runs kernels on the CPU (``TRITON_INTERPRET=1``, read at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def interpreter_problem(triton_version: Optional[str] = None, numpy_version: Optional[str] = None):
    """Why Triton's interpreter cannot run these kernels in this environment (None: it can):
    before Triton 3.7 it turns a loop bound loaded from memory into an int with
    ``int(array)`` of a one-element array, which numpy 2.4 refuses (the compiled kernels are
    not affected)."""
    import numpy
    import triton

    triton_version, numpy_version = triton_version or triton.__version__, numpy_version or numpy.__version__
    if release(triton_version) < (3, 7) and release(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter cannot run these kernels with numpy {numpy_version} "
                f"(a loop bound loaded from memory; fixed in Triton 3.7): use numpy < 2.4 to run them on the CPU")
    return None


def refuses(query: torch.Tensor, graph: AttentionGraph, dropout_p: float = 0.0):
    """Why the kernels cannot run these inputs (None: they can): CUDA tensors (any device
    under the interpreter) of a dtype and head dim in ``CONFIGS``, at most
    ``MAX_BATCH_HEADS`` sentences x heads, a square graph, and with dropout at most
    ``MAX_DROPOUT_NODES`` nodes."""
    if not (query.is_cuda or interpreted()):
        return f"CUDA tensors only (any device with TRITON_INTERPRET=1), got {query.device}"
    problem = interpreted() and interpreter_problem()
    if problem:
        return problem
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


@dataclass(frozen=True)
class Variant:
    """Which binary of a kernel a call launches: the features that are constexprs, so that a
    call without them runs none of their instructions."""

    dropout: bool = False
    rel: bool = False  # relative keys
    padding: bool = False  # a key padding mask is read


def kernel_constants(kernel: str, dtype: torch.dtype, head_dim: int, config: LaunchConfig,
                     variant: Variant, upcast: bool = False) -> dict:
    """The constexpr arguments of a launch (shared with the ahead-of-time compile); the key
    kernel's tiles are the transposed ones (block_m keys x block_n query slots). The merges
    take the plan's block (their parts' rows) and no products or dropout; of the variant only
    the dQ merge reads one feature (relative keys). ``upcast``: the interpreter's bf16, whose
    operands are fp32 and whose roundings are emulated."""
    if kernel in MERGE_KERNELS:
        constants = dict(D=head_dim, BLOCK_M=config.block_m, UPCAST=upcast)
        if kernel == "merge_grad_q":
            constants.update(HAS_REL=variant.rel, REL_TERM=dtype != torch.float32)
        return constants
    if kernel in REL_KERNELS:
        table = kernel == "rel_table"  # rows x types; the gradient's kernels types x rows
        constants = dict(D=head_dim, BLOCK_T=config.block_n if table else config.block_m)
        if kernel != "rel_grad_sum":
            constants.update(BLOCK_R=config.block_m if table else config.block_n,
                             PRECISION=DOT_PRECISION[torch.float32])
        if kernel == "rel_grad_partial":
            constants["CHUNK_STEPS"] = REL_CHUNK_STEPS
        return constants
    rows, cols = config.block_m, config.block_n
    if kernel == "backward_key":
        rows, cols = cols, rows
    constants = dict(D=head_dim, BLOCK_M=rows, BLOCK_N=cols, PRECISION=DOT_PRECISION[dtype],
                     DROPOUT=variant.dropout, HAS_REL=variant.rel, HAS_PAD=variant.padding,
                     UPCAST=upcast)
    if kernel in ("backward_query", "backward_query_rel_sums"):
        alone, split = kernel == "backward_query_rel_sums", splits_rel_sums(dtype, head_dim)
        constants.update(GRAD_Q=not alone, REL_SUMS=alone or not split,
                         REL_TERM=not alone and dtype != torch.float32)
    return constants


def device_guard(tensor: torch.Tensor):
    """The tensor's CUDA device made current for a launch: Triton launches on the current
    device, which need not be the tensors' (inputs on cuda:1 in a process on cuda:0)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _launch(name, grid, dtype, head_dim, variant: Variant, *args):
    """Launch kernel ``name`` in its configuration for (dtype, head dim) and ``variant``;
    ``args[0]`` is a tensor on the launch's device."""
    config = launch_table(_capability(args[0].device))[(name, dtype, head_dim)]
    # the interpreter's bf16 tl.dot is wrong (Triton issue 11584): compute those in fp32
    upcast = interpreted() and dtype == torch.bfloat16
    constants = kernel_constants(name, dtype, head_dim, config, variant, upcast)
    with device_guard(args[0]):
        KERNELS[name][grid](*args, **constants, num_warps=config.num_warps,
                            num_stages=config.num_stages, maxnreg=config.max_registers)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned start: the alignment the binaries are compiled for."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _strides(t: torch.Tensor) -> Tuple[int, int, int]:
    """The batch, head and node strides of a [B, H, N, D] tensor as the kernels take them: a
    dim of size 1 gets stride 0 (never read; Triton would specialise a stride of 1)."""
    return tuple(0 if t.size(dim) == 1 else t.stride(dim) for dim in range(3))


def _in_place(t: torch.Tensor) -> torch.Tensor:
    """A [B, H, N, D] tensor the kernels read where it is (fairseq's time-first views
    included): unit stride over D, the other strides multiples of 16 elements and a 16-byte
    aligned start, the specialisation the binaries are compiled for; else a contiguous copy."""
    if (t.stride(-1) == 1 and all(s % 16 == 0 for s in _strides(t)) and t.data_ptr() % 16 == 0):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def empty_in_layout(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An empty [B, H, N, D] tensor whose dims lie in memory in the order of ``t``'s strides
    (D innermost): the output and gradients of time-first inputs are time-first, so that
    fairseq's merge of heads and the projections' backward read them as views."""
    order = sorted(range(3), key=lambda dim: -t.stride(dim))  # stable: ties keep dim order
    return torch.empty_permuted(t.shape, (*order, 3), dtype=dtype or t.dtype, device=t.device)


def _scalars(rel_table, pad, lse, seed, tiles: TilePlan, num_nodes, heads, batch_heads, scale, dropout_p):
    """(``Variant``, the trailing kernel arguments shared by the three kernels). A pointer the
    variant never reads is another tensor (no allocation): without relative keys the table's
    is lse, without padding the mask's and without dropout the seed's the plan's slot table
    (viewed as uint8 and int64)."""
    variant = Variant(dropout_p > 0, rel_table.numel() > 0, pad is not None)
    num_types = rel_table.size(-1) if variant.rel else 1
    pad = tiles.slot_node.view(torch.uint8) if pad is None else _aligned(pad)
    seed = tiles.slot_node.view(torch.int64) if seed is None else _aligned(seed)
    return variant, (rel_table if variant.rel else lse, pad, num_nodes, num_types, heads, batch_heads,
                     float(scale), seed, int(round(dropout_p * 2**24)), 1.0 / (1.0 - dropout_p))


# The kernels as torch.library ops on tensors (the plan's tensors, the padding mask, the
# dropout seed) and scalars, with fake implementations and registered autograd:
# torch.compile traces them without a graph break. ``attention_forward`` and
# ``attention_backward`` are their implementations (what a glue count steps into).

def attention_forward(q: Tensor, k: Tensor, v: Tensor, rel_key: Optional[Tensor], pad: Optional[Tensor],
                      plan: List[Tensor], plan_sizes: List[int], scale: float, dropout_p: float,
                      seed: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k, v: [B, H, N, D], any strides (``_in_place``); pad: uint8 [B, N] (1 = absent),
    None: every key present (a binary that reads no mask); plan: ``TilePlan.tensors()``,
    plan_sizes: ``TilePlan.sizes()``; seed: int64 tensor on the device, its first element read
    (None without dropout). Returns (out [B, H, N, D] in q's memory order
    (``empty_in_layout``), lse fp32 [B*H, N], the fp32 table scale * log2(e) * q . rel_key
    [B*H*N, T], [0] without relative keys)."""
    with autocast_off(q.device):
        bsz, heads, num_nodes, dim = q.shape
        bh = bsz * heads
        q, k, v = (_in_place(x) for x in (q, k, v))
        tiles = TilePlan.from_tensors(plan, plan_sizes, num_nodes)
        rel_table = q.new_empty(0, dtype=torch.float32)
        if rel_key is not None:  # scale * q . rel_key[t] for every row and type, in base 2
            rel_table = relative_key_table(q, _aligned(rel_key.float()), scale)
        out = empty_in_layout(q)
        lse = torch.empty(bh, num_nodes, device=q.device)
        work = tiles.query_work
        part_out = torch.empty(work.num_parts, bh, tiles.block_m, dim, device=q.device)
        part_lse = torch.empty(work.num_parts, bh, tiles.block_m, device=q.device)
        variant, scalars = _scalars(rel_table, pad, lse, seed, tiles, num_nodes, heads, bh,
                                    scale, dropout_p)
        _launch("forward", (work.items.size(0), bh), q.dtype, dim, variant,
                q, k, v, out, lse, part_out, part_lse, tiles.slot_node, work.items,
                tiles.tile_start, tiles.tile_types, *scalars[:2],
                *_strides(q), *_strides(k), *_strides(v), *_strides(out), *scalars[2:])
        merge_forward(out, lse, part_out, part_lse, work)
        return out, lse, rel_table


# The merges of split blocks (``triton_kernels``' merge kernels): one program per (split
# block, sentence x head), a grid of the plan's shapes; nothing to launch without split
# blocks. Targets are [B, H, N, D] in any layout (``_strides``); parts are fp32 [parts, B*H,
# block_m, D] (log-sum-exps [parts, B*H, block_m]), as the tile kernels write them.

def _launch_merge(name: str, target: Tensor, work: WorkItems, *args, variant: Variant = Variant()) -> None:
    """Merge kernel ``name`` for ``target``'s dtype and head dim, one program per (split
    block, sentence x head) of ``work``."""
    bsz, heads, _, dim = target.shape
    _launch(name, (work.part_index.size(0), bsz * heads), target.dtype, dim, variant, *args)


def _plan_sizes(work: WorkItems) -> Tuple[int, int]:
    """(num_parts, max_parts): the merges' sizes of ``work``."""
    return work.num_parts, work.part_index.size(1)


def merge_forward(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor, work: WorkItems) -> None:
    """The rows of split query blocks in ``out`` (its dtype) and ``lse`` (fp32 [B*H, N]): their
    parts combined by log-sum-exp (a part without keys has lse -inf; a row without any key
    gets zeros and lse = +inf)."""
    if not work.num_parts:
        return
    bsz, heads, num_nodes, _ = out.shape
    _launch_merge("merge_forward", out, work, out, lse, part_out, part_lse, work.part_index, work.split_nodes,
                  *_strides(out), *_plan_sizes(work), num_nodes, heads, bsz * heads)


def merge_grad_q(grad_q: Tensor, part_grad_q: Tensor, work: WorkItems, type_sums: Tensor, rel_key32: Tensor,
                 num_types: int) -> None:
    """The rows of split query blocks in ``grad_q``: the sum of their parts, rounded once;
    with relative keys (``num_types`` > 0) also their per-(row, type) sums in ``type_sums``
    (the dQ kernel's layout, ``triton_kernels._type_sums_rows``) and, for fp16/bf16, dQ's
    relative-key term from them (``rel_key32``: fp32 [T, D]). Pointers never read without
    relative keys."""
    if not work.num_parts:
        return
    bsz, heads, num_nodes, _ = grad_q.shape
    _launch_merge("merge_grad_q", grad_q, work, grad_q, part_grad_q, work.part_index, work.split_nodes,
                  type_sums, rel_key32, *_strides(grad_q), *_plan_sizes(work), num_nodes, max(num_types, 1), heads,
                  bsz * heads, variant=Variant(rel=num_types > 0))


def merge_grad_kv(grad_k: Tensor, grad_v: Tensor, part_grad_k: Tensor, part_grad_v: Tensor,
                  work: WorkItems) -> None:
    """The rows of split key blocks in ``grad_k`` and ``grad_v`` (one launch): the sums of
    their parts."""
    if not work.num_parts:
        return
    bsz, heads, _, _ = grad_k.shape
    _launch_merge("merge_grad_kv", grad_k, work, grad_k, grad_v, part_grad_k, part_grad_v, work.part_index,
                  work.split_nodes, *_strides(grad_k), *_strides(grad_v), *_plan_sizes(work), heads,
                  bsz * heads)


# The relative-key kernels (``triton_rel_kernels``): q is read in place, rel_key as fp32 [T, D];
# rows are the flat (sentence x head, node) index.

def relative_key_table(q: Tensor, rel_key32: Tensor, scale: float) -> Tensor:
    """fp32 [B*H*N, T]: scale * log2(e) * q_row . rel_key[t], the tile kernels' table."""
    bsz, heads, num_nodes, dim = q.shape
    rows, num_types = bsz * heads * num_nodes, rel_key32.size(0)
    table = torch.empty(rows, num_types, device=q.device)
    block = CONFIGS[("rel_table", q.dtype, dim)].block_m
    _launch("rel_table", (triton.cdiv(rows, block),), q.dtype, dim, Variant(rel=True), q, rel_key32, table,
            *_strides(q), num_nodes, num_types, heads, float(scale), rows)
    return table


def relative_key_grad(q: Tensor, type_sums: Tensor, num_types: int) -> Tensor:
    """fp32 [T, D]: d rel_key[t] = sum over rows of type_sums[row, t] * q_row (the dQ kernel's
    scaled sums; rows past B*H*N, those of split blocks' parts, are not read), summed in a
    fixed order: chunks of rows, then the chunks in order."""
    bsz, heads, num_nodes, dim = q.shape
    rows = bsz * heads * num_nodes
    partial_config = CONFIGS[("rel_grad_partial", q.dtype, dim)]
    sum_config = CONFIGS[("rel_grad_sum", torch.float32, dim)]
    chunks = triton.cdiv(rows, REL_CHUNK_STEPS * partial_config.block_n)
    partial = torch.empty(chunks, num_types, dim, device=q.device)
    _launch("rel_grad_partial", (chunks, triton.cdiv(num_types, partial_config.block_m)), q.dtype, dim,
            Variant(rel=True), q, type_sums, partial, *_strides(q), num_nodes, num_types, heads, rows)
    grad = torch.empty(num_types, dim, device=q.device)
    _launch("rel_grad_sum", (triton.cdiv(num_types, sum_config.block_m),), torch.float32, dim, Variant(rel=True),
            partial, grad, num_types, chunks)
    return grad


forward_op = torch.library.custom_op("fairseq_plugins::triton_graph_attention", mutates_args=())(
    attention_forward)


@forward_op.register_fake
def _forward_fake(q, k, v, rel_key, pad, plan, plan_sizes, scale, dropout_p, seed):
    bsz, heads, num_nodes, _ = q.shape
    table = (0,) if rel_key is None else (bsz * heads * num_nodes, rel_key.size(0))
    return (empty_in_layout(q), q.new_empty((bsz * heads, num_nodes), dtype=torch.float32),
            q.new_empty(table, dtype=torch.float32))


def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       rel_key: Optional[Tensor], rel_table: Tensor, pad: Optional[Tensor], plan: List[Tensor],
                       plan_sizes: List[int], scale: float, dropout_p: float,
                       seed: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d q, d k, d v in q's dtype, each in its input's memory order, d rel_key in its own
    dtype, [0] without), recomputed from ``lse``, under the forward's dropout mask (the same
    seed tensor). Every [B, H, N, D] input is read in place (``_in_place``)."""
    with autocast_off(q.device):
        bsz, heads, num_nodes, dim = q.shape
        bh = bsz * heads
        device = q.device
        grad_out, q, k, v, out = (_in_place(x) for x in (grad_out, q, k, v, out))
        tiles = TilePlan.from_tensors(plan, plan_sizes, num_nodes)
        delta = torch.empty(bh, num_nodes, device=device)  # rowsum(dO * O), by the dQ kernel
        variant, scalars = _scalars(rel_table, pad, lse, seed, tiles, num_nodes, heads, bh,
                                    scale, dropout_p)

        work = tiles.query_work
        grad_q = empty_in_layout(q)  # written in q's dtype by the kernel
        part_grad_q = torch.empty(work.num_parts, bh, tiles.block_m, dim, device=device)
        type_sums, rel_key32 = lse, lse  # (pointers never read without relative keys)
        if rel_key is not None:  # per (row, type), then per (part row, type) of split blocks
            rel_key32 = _aligned(rel_key.float())
            type_sums = torch.zeros((bh * num_nodes + work.num_parts * bh * tiles.block_m) * rel_key.size(0),
                                    device=device)
        split = rel_key is not None and splits_rel_sums(q.dtype, dim)
        for kernel in ("backward_query_rel_sums", "backward_query")[not split:]:
            _launch(kernel, (work.items.size(0), bh), q.dtype, dim, variant,
                    q, k, v, out, grad_out, lse, delta, grad_q, part_grad_q, type_sums, rel_key32,
                    tiles.slot_node, work.items, tiles.tile_start, tiles.tile_types, tiles.tile_type_start,
                    tiles.tile_type_ids, *scalars[:2], *_strides(q), *_strides(k), *_strides(v), *_strides(out),
                    *_strides(grad_out), *_strides(grad_q), *scalars[2:])
        merge_grad_q(grad_q, part_grad_q, work, type_sums, rel_key32, rel_key.size(0) if rel_key is not None else 0)
        if rel_key is not None and q.dtype == torch.float32:  # fp32 dQ: the term of every row
            grad_q += (type_sums[:bh * num_nodes * rel_key.size(0)].view(bh * num_nodes, -1) @ rel_key32).view(q.shape)

        work = tiles.key_work
        grad_k, grad_v = empty_in_layout(k, q.dtype), empty_in_layout(v, q.dtype)
        part_grad_k, part_grad_v = (torch.empty(work.num_parts, bh, tiles.block_m, dim,
                                                device=device) for _ in range(2))
        _launch("backward_key", (work.items.size(0), bh), q.dtype, dim, variant,
                q, k, v, grad_out, lse, delta, grad_k, grad_v, part_grad_k, part_grad_v,
                tiles.slot_node, tiles.slot_node.numel(), work.items, tiles.window_start,
                tiles.window_types, *scalars[:2], *_strides(q), *_strides(k), *_strides(v),
                *_strides(grad_out), *_strides(grad_k), *_strides(grad_v), *scalars[2:])
        merge_grad_kv(grad_k, grad_v, part_grad_k, part_grad_v, work)

        grad_rel = q.new_empty(0)
        if rel_key is not None:
            grad_rel = relative_key_grad(q, type_sums, rel_key.size(0)).to(rel_key.dtype)
        return grad_q, grad_k, grad_v, grad_rel


backward_op = torch.library.custom_op("fairseq_plugins::triton_graph_attention_backward", mutates_args=())(
    attention_backward)


@backward_op.register_fake
def _backward_fake(grad_out, q, k, v, out, lse, rel_key, rel_table, pad, plan, plan_sizes,
                   scale, dropout_p, seed):
    grad_rel = q.new_empty(0) if rel_key is None else rel_key.new_empty(rel_key.shape)
    return (empty_in_layout(q), empty_in_layout(k, q.dtype), empty_in_layout(v, q.dtype),
            grad_rel)


def _setup_context(ctx, inputs, output):
    q, k, v, rel_key, pad, plan, plan_sizes, scale, dropout_p, seed = inputs
    out, lse, rel_table = output
    ctx.save_for_backward(q, k, v, out, lse, rel_key, rel_table, pad, seed, *plan)
    ctx.scalars = (plan_sizes, scale, dropout_p)
    ctx.set_materialize_grads(False)  # lse and the table get no gradient: no zeros to fill


def _backward(ctx, grad_out, grad_lse, grad_table):
    q, k, v, out, lse, rel_key, rel_table, pad, seed, *plan = ctx.saved_tensors
    plan_sizes, scale, dropout_p = ctx.scalars
    if grad_out is None:  # the output does not reach the loss
        grad_out = torch.zeros_like(out)
    grad_q, grad_k, grad_v, grad_rel = backward_op(
        grad_out, q, k, v, out, lse, rel_key, rel_table, pad, plan, plan_sizes, scale,
        dropout_p, seed)
    # (the list of plan tensors gets a list of Nones: the inputs' structure)
    return (grad_q, grad_k, grad_v, None if rel_key is None else grad_rel, None, [None] * len(plan),
            None, None, None, None)


torch.library.register_autograd("fairseq_plugins::triton_graph_attention", _backward,
                                setup_context=_setup_context)


def triton_graph_attention(query, key, value, graph, rel_key=None, key_padding_mask=None,
                           dropout_p=0.0, scale=None, seed=None):
    """Backend function (see ``graph_attention`` for the semantics), called by it with checked
    inputs that this backend accepts (``refuses``), a float scale, a graph with edges and,
    with dropout, the op's seed tensor (``registry.dropout_seed``)."""
    plan = plan_on(graph, *tiles(query.dtype, query.size(-1)), query.device)
    return attend(query, key, value, plan, rel_key, key_padding_mask, float(scale), float(dropout_p), seed)


def attend(query, key, value, plan: TilePlan, rel_key, key_padding_mask, scale: float,
           dropout_p: float, seed: Optional[Tensor] = None) -> torch.Tensor:
    """The op over ``plan`` (which the tests build with other work splits); query, key,
    value go in as they are (views of fairseq's time-first layout included); ``seed``: the
    dropout stream (``registry.dropout_seed``; the kernels read its first element), needed
    with dropout."""
    if dropout_p > 0 and seed is None:
        raise ValueError("dropout needs the op's seed tensor: pass seed=registry.dropout_seed(device, dropout_p)")
    pad = None  # a binary that reads no mask
    if key_padding_mask is not None:  # bool: viewed as uint8, no copy
        pad = key_padding_mask.to(query.device)
        pad = pad.view(torch.uint8) if pad.dtype == torch.bool else pad.to(torch.uint8)
    out, _, _ = forward_op(query, key, value, rel_key, pad, list(plan.tensors()), list(plan.sizes()),
                           scale, dropout_p, seed if dropout_p > 0 else None)
    return out


def prepare(query: torch.Tensor, graph: AttentionGraph) -> None:
    """The graph's tile plan for this dtype and head dim, on the query's device."""
    if graph.num_edges:  # (an edgeless graph needs none: its output is zeros)
        plan_on(graph, *tiles(query.dtype, query.size(-1)), query.device)


BACKEND = Backend("triton", triton_graph_attention, refuses, prepare, seeded=True)
