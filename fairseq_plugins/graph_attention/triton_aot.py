"""Ahead-of-time compile of the triton backend's launch configurations for real GPUs, no GPU needed.

The interpreter proves the arithmetic but never compiles a kernel: one that spills registers,
overflows shared memory or misses the tensor cores passes it. Triton compiles for an explicit
target on any machine, so the binaries the backend launches (each launch-table entry in its
``variants``: the tile kernels with and without dropout, each without and with relative keys and
padding, and the merges of split blocks) are compiled here for sm_80 and sm_90a and checked
against what a GPU would reject or run slowly:

* zero spill stores and loads in the ptxas report of the shipped binary (register counts
  alone mislead: a badly spilling kernel can report few registers), and at most
  ``MAX_REGISTERS`` registers a thread (headroom under ptxas's 255: a newer Triton or a small
  kernel change near the cap turns into spills);
* ``metadata.shared`` within the target's per-block limit (Triton checks it only at load);
* the tensor-core product on the dtype's operands in the PTX (``wgmma.mma_async`` on sm_90a
  for 64-row tiles, ``mma.sync`` for smaller ones and on sm_80), for the tile kernels: the
  merges multiply no matrices (``NO_PRODUCTS``), so none is required of them.

Pointers are compiled as 16-byte aligned and the tensors' int64 strides as multiples of 16
elements (the backend guarantees both, copying a tensor that is neither), and the other
scalars are never specialised (``triton_kernels.SCALARS``), so these are the binaries a
launch builds.

    python -m fairseq_plugins.graph_attention.triton_aot [--capabilities 80 90] [--json FILE]

Each compile runs in a fresh process (``TRITON_INTERPRET`` unset, no GPU visible, a private
cache so that ptxas runs and reports). Each report also carries the instruction mix of the
kernel's tile loop, read from the binary's SASS (``tile_loop``): what the work model
(``scripts/triton_work_model.py``) turns into issue-bound times. ``triton_budget`` runs this
module under every Triton a supported torch pins.
"""

import contextlib
import io
import json
from collections import Counter
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from ..command_line import command_parser

# capability -> (PTX target name, NVIDIA's maximum shared memory per block in bytes)
TARGETS = {80: ("sm_80 (A100)", 166912), 90: ("sm_90a (H100)", 232448)}
OPERAND_TYPES = {"float32": "tf32", "float16": "f16", "bfloat16": "bf16"}  # of the MMA
WARPGROUP_ROWS = 64  # a wgmma product's rows: smaller tiles run mma.sync on sm_90a too
REGISTERS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
MAX_REGISTERS = 240  # the budget: ptxas allows 255; the rest is headroom for other Triton versions
DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# kernels without a matrix product (weighted sums of their parts' rows): no tensor-core
# instruction is required of them, and they have no dropout to compile
NO_PRODUCTS = ("merge_forward", "merge_grad_q", "merge_grad_kv", "rel_grad_sum")


def _rel_kernels():
    """The relative-key kernels: launched with relative keys only, their products in fp32
    (tf32 operands) whatever the dtype."""
    from fairseq_plugins.graph_attention.triton_backend import REL_KERNELS

    return REL_KERNELS


@dataclass(frozen=True)
class Configuration:
    kernel: str  # key of triton_backend.KERNELS
    dtype: str  # torch dtype name
    head_dim: int
    block_m: int  # the plan's tile (triton_backend.LaunchConfig)
    block_n: int
    num_warps: int
    num_stages: int
    dropout: bool  # the DROPOUT constexpr: each configuration is launched with and without
    max_registers: Optional[int] = None  # ptxas's cap a thread (maxnreg); None: its own
    # the HAS_REL and HAS_PAD constexprs (``triton_backend.Variant``): compiled without either
    # and with both (the binaries with one of them lie between those two)
    rel_and_padding: bool = True


@dataclass(frozen=True)
class CompileReport:
    configuration: Configuration
    capability: int
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int  # bytes of shared memory per block
    tensor_core: Optional[bool]  # the PTX has ``tensor_core_instruction``; None: none required
    loop: Optional[Dict[str, int]] = None  # ``tile_loop`` of the SASS; None: no loop found

    def problems(self) -> List[str]:
        """What a GPU would reject or run slowly, or what breaks the register budget (empty
        when the binary is fine)."""
        found = []
        if self.registers > MAX_REGISTERS:
            found.append(f"{self.registers} registers > {MAX_REGISTERS}")
        if self.spill_stores or self.spill_loads:
            found.append(f"spills {self.spill_stores} B stores / {self.spill_loads} B loads")
        if self.shared > TARGETS[self.capability][1]:
            found.append(f"shared memory {self.shared} B > {TARGETS[self.capability][1]} B")
        if self.tensor_core is False:
            found.append(f"no {tensor_core_instruction(self.configuration, self.capability)} "
                         "in the PTX")
        return found

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks per SM allowed by registers, threads and shared memory."""
        threads = 32 * self.configuration.num_warps
        by_registers = REGISTERS_PER_SM // max(self.registers * threads, 1)
        by_shared = TARGETS[self.capability][1] // max(self.shared, 1)
        return min(by_registers, by_shared, MAX_THREADS_PER_SM // threads, MAX_BLOCKS_PER_SM)


def reports_from(written: dict) -> List[CompileReport]:
    """The reports in what ``main --json`` wrote (read as JSON)."""
    return [CompileReport(**{**r, "configuration": Configuration(**r["configuration"])})
            for r in written["reports"]]


def tensor_core_instruction(configuration: Configuration, capability: int) -> Optional[str]:
    """The tensor-core product (a regular expression over the PTX) a configuration must
    use: ``wgmma.mma_async`` on sm_90a when its products have 64 rows, else ``mma.sync``; on
    the dtype's operands (tf32 for fp32). None for a kernel without products
    (``NO_PRODUCTS``)."""
    if configuration.kernel in NO_PRODUCTS:
        return None
    t = OPERAND_TYPES["float32" if configuration.kernel in _rel_kernels() else configuration.dtype]
    if capability >= 90 and configuration.block_m >= WARPGROUP_ROWS:
        return rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k\d+\.f32\.{t}\.{t}"
    return rf"mma\.sync\.aligned\.m16n8k\d+\.row\.col\.f32\.{t}\.{t}\.f32"


# SASS opcodes (the part before the first dot) by what they spend an issue slot on; the rest
# (branches, barriers, warpgroup fences, shuffles, special registers) is "sync and control"
INSTRUCTION_CLASSES = {
    "tensor core": ("HGMMA", "HMMA", "IMMA", "QGMMA"),
    "floating point": ("FADD", "FMUL", "FFMA", "FMNMX", "MUFU", "FSEL", "FCHK", "HADD2", "HMUL2", "HFMA2",
                       "HMNMX2", "DADD", "DMUL", "DFMA"),
    "conversion": ("F2F", "F2FP", "F2I", "I2F", "I2FP", "FRND"),
    "integer and address": ("IMAD", "IADD3", "IADD", "IMUL", "LEA", "LOP3", "SHF", "SEL", "PRMT", "SGXT", "MOV",
                            "IABS", "IMNMX", "VIADD", "VIMNMX", "BMSK", "POPC", "FLO", "BREV", "CS2R", "IDP"),
    "predicate": ("ISETP", "FSETP", "DSETP", "PLOP3", "P2R", "R2P", "VOTE", "PSETP", "HSETP2"),
    "memory": ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDGSTS", "LDGDEPBAR", "LD", "ST", "LDC", "ATOM",
               "ATOMG", "ATOMS", "RED", "REDG", "UTMALDG", "UTMASTG", "UBLKCP"),
}
_CLASS_OF = {opcode: name for name, opcodes in INSTRUCTION_CLASSES.items() for opcode in opcodes}
_LABEL = re.compile(r"^(\w+):$")
_WARPGROUP_MMA = re.compile(r"^[HQ]GMMA\.(\d+)x(\d+)x(\d+)")  # a warpgroup's (4 warps') product, m x n x k
_WARP_MMA = re.compile(r"^HMMA\.16(8)(\d+)")  # one warp's product, 16 x 8 x k
_BRANCH = re.compile(r"\bBRA(?:\.\w+)* (\w+);")


def instruction_class(opcode: str) -> str:
    """The class of a SASS opcode (``HGMMA.64x32x16.F32.BF16`` -> "tensor core"); the other
    uniform-datapath instructions (``U...``) are "uniform"."""
    base = opcode.split(".")[0]
    if base in _CLASS_OF:
        return _CLASS_OF[base]
    return "uniform" if base.startswith("U") else "sync and control"


def tensor_flops(opcode: str) -> int:
    """FLOPs of one warp's issue of a tensor-core opcode: a warpgroup product counts a
    quarter of its 2 m n k (each of its 4 warps issues it); 0 for any other opcode."""
    found = _WARPGROUP_MMA.match(opcode)
    if found:
        m, n, k = map(int, found.groups())
        return 2 * m * n * k // 4
    found = _WARP_MMA.match(opcode)
    return 2 * 16 * int(found.group(1)) * int(found.group(2)) if found else 0


def tile_loop(sass: str) -> Optional[Dict[str, int]]:
    """The instruction mix of the kernel's tile loop in its SASS (Triton's ``asm["sass"]``: a
    line per instruction, control bits and instruction separated by a tab, labels on their
    own lines): among the loops (a label and a later branch back to it), the one with the
    most tensor-core instructions, the innermost of those, the longest of several such (a
    kernel without products: its longest loop). The counts are the loop body's static instructions (a branch inside it
    would skip some; the tile kernels' bodies are predicated straight-line code), by
    ``instruction_class``, with their ``total``, ``stall_cycles`` (the fixed stall cycles
    the control bits give after each instruction: the least time one warp needs per
    iteration) and ``tensor_flops`` (per warp, ``tensor_flops``); ``nested`` and
    ``nested_stall_cycles``: those of the loops inside it (the dQ kernel's loop over a
    tile's edge types), counted once in the totals. None: no loop."""
    rows, labels, loops = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(rows)
            continue
        if "\t" not in line:
            continue
        control, instruction = line.split("\t", 1)
        words = instruction.split()
        opcode = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        rows.append((control, opcode.rstrip(";")))
        branch = _BRANCH.search(instruction)
        if branch and branch.group(1) in labels:
            loops.append((labels[branch.group(1)], len(rows)))
    if not loops:
        return None

    def products(loop):
        return sum(instruction_class(op) == "tensor core" for _, op in rows[loop[0]:loop[1]])

    most = max(map(products, loops))
    candidates = [loop for loop in loops if products(loop) == most]
    if most:  # innermost: no other candidate inside it (a short loop of as many products
        # after the tile loop, such as the dQ kernel's relative-key term, is not nested in it)
        candidates = [(s0, e0) for s0, e0 in candidates
                      if not any(s0 <= s1 and e1 <= e0 and (s1, e1) != (s0, e0) for s1, e1 in candidates)]
    start, end = max(candidates, key=lambda loop: loop[1] - loop[0])
    counts = Counter(instruction_class(op) for _, op in rows[start:end])

    def stalls(first, last):
        return sum(int(control.rsplit(":", 1)[1], 16) for control, _ in rows[first:last])

    inner = [(s, e) for s, e in loops if start <= s and e <= end and (s, e) != (start, end)]
    inner = [(s0, e0) for s0, e0 in inner if not any(s1 <= s0 and e0 <= e1 and (s1, e1) != (s0, e0)
                                                     for s1, e1 in inner)]
    return {**{name: counts[name] for name in (*INSTRUCTION_CLASSES, "uniform", "sync and control")},
            "total": end - start, "stall_cycles": stalls(start, end),
            "tensor_flops": sum(tensor_flops(op) for _, op in rows[start:end]),
            "nested": sum(e - s for s, e in inner), "nested_stall_cycles": sum(stalls(s, e) for s, e in inner)}


def variants(kernel: str):
    """(dropout, rel_and_padding) of the binaries compiled for ``kernel``: a tile kernel's
    four (dropout off and on; without relative keys and padding, the lightest, and with both,
    the heaviest); the dQ merge's two (relative keys are its only feature); the other
    merges' one."""
    if kernel == "merge_grad_q":
        return [(False, False), (False, True)]
    if kernel in _rel_kernels():
        return [(False, True)]
    if kernel == "backward_query_rel_sums":  # relative keys only
        return [(dropout, True) for dropout in (False, True)]
    if kernel in NO_PRODUCTS:
        return [(False, False)]
    return [(dropout, extras) for dropout in (False, True) for extras in (False, True)]


def launched_configurations(capability: int = 90) -> List[Configuration]:
    """The configurations the backend launches on a GPU of ``capability``: its launch table
    (``triton_backend.launch_table``), entry by entry, in each of the kernel's ``variants``."""
    from fairseq_plugins.graph_attention.triton_backend import launch_table

    return [Configuration(kernel, str(dtype).replace("torch.", ""), dim, c.block_m, c.block_n,
                          c.num_warps, c.num_stages, dropout, c.max_registers, extras)
            for (kernel, dtype, dim), c in launch_table(capability).items()
            for dropout, extras in variants(kernel)]


def compile_constants(configuration: Configuration) -> dict:
    """The constexpr arguments this configuration is compiled with (those of a launch on a
    GPU, where ``UPCAST`` is off)."""
    import torch

    from fairseq_plugins.graph_attention import triton_backend

    c = configuration
    return triton_backend.kernel_constants(
        c.kernel, getattr(torch, c.dtype), c.head_dim,
        triton_backend.LaunchConfig(c.block_m, c.block_n, c.num_warps, c.num_stages),
        triton_backend.Variant(c.dropout, c.rel_and_padding, c.rel_and_padding))


def signature(kernel, dtype: str, constants: dict) -> dict:
    """Argument types as the backend passes them."""
    element = DTYPE_NAMES[dtype]
    types = {}
    for name in kernel.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "grad_out_ptr", "grad_q_ptr", "grad_k_ptr",
                      "grad_v_ptr"):
            types[name] = f"*{element}"
        elif name.endswith("types_ptr"):
            types[name] = "*i16"
        elif name in ("slot_node_ptr", "items_ptr", "tile_start_ptr", "tile_type_start_ptr",
                      "tile_type_ids_ptr", "window_start_ptr", "part_index_ptr", "split_nodes_ptr"):
            types[name] = "*i32"
        elif name == "pad_ptr":
            types[name] = "*u8"
        elif name == "seed_ptr":
            types[name] = "*i64"
        elif name.endswith("_ptr"):
            types[name] = "*fp32"
        elif name.startswith("stride_"):
            types[name] = "i64"
        else:
            types[name] = "fp32" if name in ("scale", "dropout_scale") else "i32"
    return types


def compile_configuration(configuration: Configuration, capability: int) -> CompileReport:
    """Compile one configuration for ``capability`` in this process (needs the environment
    that ``compile_all`` sets up) and read its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fairseq_plugins.graph_attention import triton_backend

    kernel = triton_backend.KERNELS[configuration.kernel]
    constants = compile_constants(configuration)
    types = signature(kernel, configuration.dtype, constants)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if types[name].startswith("*") or name.startswith("stride_")}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints ptxas -v here
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=types, constexprs=constants, attrs=aligned),
            target=GPUTarget("cuda", capability, 32),
            options={"num_warps": configuration.num_warps, "num_stages": configuration.num_stages,
                     "maxnreg": configuration.max_registers})
    report = log.getvalue()
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or spills is None:
        raise RuntimeError(f"no ptxas resource report for {configuration}:\n{report}")
    instruction = tensor_core_instruction(configuration, capability)
    return CompileReport(configuration, capability, int(registers.group(1)),
                         int(spills.group(1)), int(spills.group(2)), compiled.metadata.shared,
                         None if instruction is None else
                         re.search(instruction, compiled.asm["ptx"]) is not None,
                         tile_loop(compiled.asm["sass"]))


def _compile_in_worker(arguments):
    return compile_configuration(*arguments)


@contextlib.contextmanager
def _compiler_environment(cache: str):
    """The environment processes started inside inherit: no interpreter, no GPU, a private
    cache (so that ptxas runs and reports), the ptxas log on stdout. Spawned processes import
    the caller's main module before anything else runs in them, so the variables must be set
    when they start."""
    saved = dict(os.environ)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.update(CUDA_VISIBLE_DEVICES="", TRITON_CACHE_DIR=cache, TRITON_DUMP_PTXAS_LOG="1",
                      TRITON_DEFAULT_FP_FUSION="1")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def compile_all(jobs, workers: int = 2) -> List[CompileReport]:
    """``compile_configuration(*job)`` for every job, in fresh processes; a report per job,
    in order."""
    import multiprocessing

    with tempfile.TemporaryDirectory() as cache, _compiler_environment(cache):
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            return list(pool.map(_compile_in_worker, jobs))


def main(argv=None):
    parser = command_parser(description=__doc__.splitlines()[0])
    parser.add_argument("--capabilities", type=int, nargs="+", default=sorted(TARGETS),
                        choices=sorted(TARGETS), help="compute capabilities to compile for (default: all)")
    parser.add_argument("--kernels", nargs="+", metavar="KERNEL",
                        help="compile only these kernels' configurations (default: every launched one)")
    parser.add_argument("--workers", type=int, default=2, help="compiling processes (default: %(default)s)")
    parser.add_argument("--json", help="also write the reports here, with the Triton that compiled them")
    args = parser.parse_args(argv)
    jobs = [(c, cc) for cc in args.capabilities for c in launched_configurations(cc)
            if args.kernels is None or c.kernel in args.kernels]
    reports = compile_all(jobs, args.workers)
    print("| target | kernel | dtype | D | tile | warps | stages | dropout | rel. keys + padding | registers "
          "| spills | shared KiB | blocks/SM | tensor cores |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in reports:
        c = r.configuration
        instruction = tensor_core_instruction(c, r.capability)
        product = ("none needed (no products)" if instruction is None else
                   ("wgmma" if "wgmma" in instruction else "mma.sync") if r.tensor_core else "NO")
        tile = f"{c.block_m} rows" if instruction is None else f"{c.block_m} x {c.block_n}"
        print(f"| {TARGETS[r.capability][0]} | {c.kernel} | {c.dtype} | {c.head_dim} "
              f"| {tile} | {c.num_warps} | {c.num_stages} "
              f"| {'on' if c.dropout else 'off'} | {'on' if c.rel_and_padding else 'off'} | {r.registers} "
              f"| {r.spill_stores + r.spill_loads} | {r.shared / 1024:.1f} | {r.blocks_per_sm} "
              f"| {product} |")
    if args.json:
        import triton

        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "triton_path": os.path.dirname(triton.__file__),
                       "reports": [asdict(r) for r in reports]}, f, indent=1)
    bad = [(r.configuration, r.capability, r.problems()) for r in reports if r.problems()]
    for configuration, capability, problems in bad:
        print(f"FAIL {configuration} sm_{capability}: {'; '.join(problems)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
