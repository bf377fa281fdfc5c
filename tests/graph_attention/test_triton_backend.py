"""The triton backend under the Triton interpreter (CPU), against the float64 torch reference.

Forward and every gradient (q, k, v, rel_key) on BPT (k 1/2/4/8, causal), SegTree and random
tree-laid graphs, with padding, rows without keys, dropout (the mask the kernels hash, rebuilt
here in torch) and split blocks; fp32, fp16 and bf16 (upcast to fp32 for tl.dot under the
interpreter, Triton issue 11584). The interpreter is slow (about 10 ms per tile and kernel
on an idle core): the cases use one head and few programs.
"""

import contextlib
import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")
from fairseq_plugins.graph_attention import graph_attention, tile_plan  # noqa: E402
from fairseq_plugins.graph_attention import triton_aot, triton_backend  # noqa: E402
from fairseq_plugins.graph_attention.registry import dropout_seed  # noqa: E402
from fairseq_plugins.graphs.binary_partition import (  # noqa: E402
    bpt_graph, node_present, segtree_graph,
)
from fairseq_plugins.check_gpu.cases import TILED_GRAPHS, random_tree_graph  # noqa: E402

from tests.triton_interpreter import skip_reason  # noqa: E402
from tests.cli import REPO

pytestmark = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason())

# max |error| / max(max |reference|, 1) per dtype; inputs are rounded to the dtype first
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def keep_mask(seed: int, batch_heads: int, num_nodes: int, dropout_p: float) -> torch.Tensor:
    """[BH, N, N] bool: the keep bits the kernels hash (``triton_kernels._keep``), in torch."""
    mask32 = 0xFFFFFFFF

    def mix(x):
        x = x ^ (x >> 16)
        x = (x * 0x85EBCA6B) & mask32
        x = x ^ (x >> 13)
        x = (x * 0xC2B2AE35) & mask32
        return x ^ (x >> 16)

    bh = torch.arange(batch_heads, dtype=torch.int64)
    stream = mix(seed ^ ((bh * 0x9E3779B9) & mask32))
    nodes = torch.arange(num_nodes, dtype=torch.int64)
    counter = (nodes[:, None] * num_nodes + nodes[None, :]) & mask32
    bits = mix(counter[None] ^ stream[:, None, None])
    return (bits >> 8) >= round(dropout_p * 2**24)


def dense_reference(q, k, v, graph, rel_key, key_padding_mask, scale, keep=None, dropout_p=0.0):
    """float64 [N, N] attention with -inf off the graph and an explicit dropout mask."""
    n = graph.num_nodes
    valid = torch.zeros(n, n, dtype=torch.bool)
    valid[graph.rows(), graph.indices] = True
    types = torch.zeros(n, n, dtype=torch.long)
    types[graph.rows(), graph.indices] = graph.edge_type
    scores = q @ k.transpose(-1, -2) + torch.gather(q @ rel_key.T, -1, types.expand(*q.shape[:2], n, n))
    valid = valid & ~key_padding_mask[:, None, None, :]
    probs = torch.softmax((scores * scale).masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0)
    if keep is not None:
        probs = probs * keep.view(probs.shape) / (1 - dropout_p)
    return probs @ v


def inputs(graph, lengths, dtype, dim=32, heads=1, seed=0, device="cpu"):
    """(q, k, v, rel_key) in ``dtype`` on ``device``, float64 CPU copies of the same values,
    and the mask (on ``device``)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(lengths), heads, graph.num_nodes, dim)
    low = [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]
    low.append((0.5 * torch.randn(graph.num_edge_types, dim, generator=gen)).to(dtype))
    mask = ~node_present(torch.tensor(lengths), graph.tree.num_tokens)
    return ([x.to(device).requires_grad_() for x in low],
            [x.detach().double().requires_grad_() for x in low], mask.to(device))


def assert_close(actual, expected, dtype, what, tolerance=None):
    error = (actual.double().cpu() - expected).abs().max().item()
    limit = (tolerance or TOLERANCE)[dtype] * max(expected.abs().max().item(), 1.0)
    assert error <= limit, f"{what}: max error {error:.3g} > {limit:.3g}"


def check(graph, lengths, dtype=torch.float32, dropout_p=0.0, plan=None, seed=0, dim=32,
          device="cpu", tolerance=None):
    """Forward and every gradient of the triton backend against the float64 reference (on
    the CPU, whatever ``device`` the backend runs on)."""
    low, ref, mask = inputs(graph, lengths, dtype, dim, seed=seed, device=device)
    mask_cpu = mask.cpu()
    scale = low[0].size(-1) ** -0.5
    torch.manual_seed(seed)
    if plan is None:
        out = graph_attention(*low[:3], graph, low[3], mask, dropout_p, backend="triton")
    else:
        out = triton_backend.attend(*low[:3], plan, low[3], mask, scale, dropout_p,
                                    dropout_seed(low[0].device, dropout_p))
    keep = None
    if dropout_p > 0:  # the kernel's seed is the first draw after torch.manual_seed(seed)
        torch.manual_seed(seed)
        kernel_seed = int(torch.randint(0, 2**31 - 1, ()).item())
        keep = keep_mask(kernel_seed, low[0].size(0) * low[0].size(1), graph.num_nodes,
                         dropout_p)
    if dropout_p > 0:
        expected = dense_reference(*ref[:3], graph, ref[3], mask_cpu, scale, keep, dropout_p)
    else:
        expected = graph_attention(*ref[:3], graph, ref[3], mask_cpu, backend="torch")
    assert_close(out, expected, dtype, "output", tolerance)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad(out, low, grad.to(device, dtype))
    expected_grads = torch.autograd.grad(expected, ref, grad.double())
    for name, actual, wanted in zip(("q", "k", "v", "rel_key"), grads, expected_grads):
        assert_close(actual, wanted, dtype, f"grad {name}", tolerance)
    return out


GRAPHS = {**TILED_GRAPHS, "bpt-k1-n2049": (lambda: bpt_graph(2049, 1), [2049])}


@pytest.mark.parametrize("name", GRAPHS)
def test_fp32_forward_and_gradients_match_the_reference(name):
    build, lengths = GRAPHS[name]
    check(build(), lengths)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["bpt-k4-n100", "segtree-n64"])
def test_half_precision_matches_the_reference(name, dtype):
    build, lengths = GRAPHS[name]
    check(build(), lengths, dtype)


class LaunchRecorder:
    """Stands in for a kernel in ``triton_backend.KERNELS``: records every launch, runs it."""

    def __init__(self, name, launches):
        self.name, self.kernel, self.launches = name, triton_backend.KERNELS[name], launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


ARGUMENT_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
                  torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}


def argument_type(name, value) -> str:
    if isinstance(value, torch.Tensor):
        assert value.data_ptr() % 16 == 0, "the binaries are compiled for 16-byte alignment"
        return ARGUMENT_TYPES[value.dtype]
    if isinstance(value, float):
        return "fp32"
    assert isinstance(value, int) and -2**31 <= value < 2**31
    if name.startswith("stride_"):  # annotated int64, compiled as multiples of 16
        assert value % 16 == 0 and value != 1, f"{name} = {value}"
        return "i64"
    return "i32"


def test_every_launch_is_a_configuration_of_the_compiled_table(monkeypatch):
    """Every dtype and head dim, with and without relative keys, padding and dropout, split
    blocks (one tile per program: the merges run): each launch has the constexprs, warps,
    stages and argument types that ``triton_aot`` compiles (``UPCAST`` aside, the
    interpreter's bf16 switch), every compiled variant is launched, a variant with relative
    keys but no padding differs from a compiled one only in those two constexprs, and the
    results match the reference at every tile size of the table."""
    launches = []
    for name in list(triton_backend.KERNELS):
        monkeypatch.setitem(triton_backend.KERNELS, name, LaunchRecorder(name, launches))
    monkeypatch.setattr(tile_plan, "TILES_PER_ITEM", 1)
    graph = bpt_graph.__wrapped__(17, 2)  # a fresh graph: its plans are built with these splits
    for dtype in triton_backend.GPU_DTYPES:
        for dim in triton_backend.HEAD_DIMS:
            check(graph, [17, 11], dtype, dropout_p=0.2, dim=dim)
            check(graph, [17, 11], dtype, dim=dim)
            (q, k, v, rel), _, _ = inputs(graph, [17], dtype, dim)
            graph_attention(q, k, v, graph, backend="triton").sum().backward()
            graph_attention(q, k, v, graph, rel, dropout_p=0.2, backend="triton").sum().backward()
            graph_attention(q, k, v, graph, dropout_p=0.2, backend="triton").sum().backward()

    table = {(c.kernel, c.dtype, c.head_dim, c.dropout, c.rel_and_padding): c
             for c in triton_aot.launched_configurations()}
    seen = set()
    for name, args, kwargs in launches:
        dtype = str(args[0].dtype).replace("torch.", "")
        constants = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages", "maxnreg")}
        assert constants.get("UPCAST", dtype == "bfloat16") == (dtype == "bfloat16")  # (fp32 products: none)
        rel = constants.get("HAS_REL", name in triton_backend.REL_KERNELS)
        mixed = "HAS_PAD" in constants and constants["HAS_PAD"] != rel
        entry = (name, dtype, constants["D"], constants.get("DROPOUT", False), rel or mixed)
        configuration = table[entry]
        between = dict(HAS_REL=rel, HAS_PAD=constants["HAS_PAD"]) if mixed else {}
        assert {**constants, "UPCAST": False} == {**triton_aot.compile_constants(configuration), **between,
                                                  "UPCAST": False}
        assert (kwargs["num_warps"], kwargs["num_stages"], kwargs["maxnreg"]) == (
            configuration.num_warps, configuration.num_stages, configuration.max_registers)
        types = triton_aot.signature(triton_backend.KERNELS[name].kernel, dtype, constants)
        names = [n for n in triton_backend.KERNELS[name].kernel.arg_names if n not in constants]
        assert len(args) == len(names)
        assert {n: argument_type(n, a) for n, a in zip(names, args)} == {n: types[n] for n in names}
        seen.add(entry)
    assert seen == set(table)
    assert any(kwargs.get("HAS_REL") and not kwargs.get("HAS_PAD") for _, _, kwargs in launches)


def test_the_kernels_of_a_dtype_and_head_dim_share_one_plan():
    for dtype in triton_backend.GPU_DTYPES:
        for dim in triton_backend.HEAD_DIMS:
            shapes = {(c.block_m, c.block_n) for (kernel, t, d), c in triton_backend.CONFIGS.items()
                      if (t, d) == (dtype, dim) and kernel not in triton_backend.REL_KERNELS}
            assert shapes == {triton_backend.tiles(dtype, dim)}


@pytest.mark.parametrize("per_item", [tile_plan.TILES_PER_ITEM, 1], ids=["whole", "split"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_at_head_dim_128_matches_the_reference(dtype, per_item):
    """Where the per-(row, type) sums have a launch of their own (``splits_rel_sums``): dQ's
    relative-key term from the complete sums, added by the dQ kernel after its tile loop
    (blocks done by one program) or by the dQ merge (split blocks)."""
    graph = bpt_graph(64, 2)
    assert triton_backend.splits_rel_sums(dtype, 128)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tile_plan, "TILES_PER_ITEM", per_item)
        plan = tile_plan.build_plan(graph, *triton_backend.tiles(dtype, 128))
    assert bool(plan.query_work.num_parts) == (per_item == 1)
    check(graph, [64, 40], dtype, plan=plan, dim=128)


@pytest.mark.parametrize("dim", [32, 128])
def test_dropout_uses_the_same_mask_forward_and_backward(dim):
    """Split blocks too: one tile per program, so every block of more than one tile is
    merged by log-sum-exp (forward) and fixed-order sums (gradients); fp32 at head dims 32
    and 128, the largest and the smallest tiles of the table."""
    graph = bpt_graph(64, 2)
    for per_item, dropout_p in ((tile_plan.TILES_PER_ITEM, 0.3), (1, 0.3), (1, 0.0)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tile_plan, "TILES_PER_ITEM", per_item)
            plan = tile_plan.build_plan(graph, *triton_backend.tiles(torch.float32, dim))
        assert per_item > 1 or plan.query_work.num_parts and plan.key_work.num_parts
        check(graph, [64, 40], dropout_p=dropout_p, plan=plan, dim=dim)


def test_dropout_keeps_about_one_minus_p():
    keep = keep_mask(12345, 4, 300, 0.25)
    assert abs(keep.float().mean().item() - 0.75) < 0.005


def test_rows_without_present_keys_are_zero_with_zero_gradients():
    graph = bpt_graph(17, 1)
    (q, k, v, rel), _, _ = inputs(graph, [17, 17], torch.float32)
    mask = torch.zeros(2, graph.num_nodes, dtype=torch.bool)
    mask[1] = True
    out = graph_attention(q, k, v, graph, rel, mask, backend="triton")
    assert out[1].abs().max() == 0 and out[0].abs().min() > 0
    out.sum().backward()
    assert q.grad[1].abs().max() == 0 and k.grad[1].abs().max() == 0


TILE_SIZES = sorted({triton_backend.tiles(t, d) for t in triton_backend.GPU_DTYPES
                     for d in triton_backend.HEAD_DIMS})


@pytest.mark.parametrize("m, n", TILE_SIZES, ids=[f"{m}x{n}" for m, n in TILE_SIZES])
def test_plan_tiles_and_windows_hold_exactly_the_edges(m, n):
    """Every tile size of the table; the key side has m keys x n query slots."""
    for graph in (bpt_graph(300, 4), segtree_graph(100, causal=True), random_tree_graph(50, 9)):
        plan = tile_plan.build_plan(graph, m, n)
        nodes_n = graph.num_nodes
        expected = torch.full((nodes_n, nodes_n + max(m, n)), -1)
        expected[graph.rows(), graph.indices] = graph.edge_type
        found = torch.full_like(expected, -1)
        for block, first, end, _ in plan.query_work.items.tolist():
            nodes = plan.slot_node[block * m:(block + 1) * m].long()
            for tile in range(first, end):
                start = int(plan.tile_start[tile])
                types = plan.tile_types[tile].long()[nodes >= 0]
                seen = found[nodes[nodes >= 0], start:start + n]
                assert bool((seen[types >= 0] == -1).all()), "an edge in two tiles"
                found[nodes[nodes >= 0], start:start + n] = torch.where(types >= 0, types, seen)
        assert torch.equal(found, expected)
        transposed = torch.full_like(expected, -1)
        slots = torch.cat([plan.slot_node.long(), torch.full((n,), -1)])
        for block, first, end, _ in plan.key_work.items.tolist():
            keys = torch.arange(block * m, block * m + m)
            for window in range(first, end):
                nodes = slots[int(plan.window_start[window]):][:n]
                types = plan.window_types[window].long().t()  # [query rows, keys]
                rows = nodes >= 0
                seen = transposed[nodes[rows][:, None], keys[None, :]]
                transposed[nodes[rows][:, None], keys[None, :]] = torch.where(
                    types[rows] >= 0, types[rows], seen)
        assert torch.equal(transposed[:, :nodes_n], expected[:, :nodes_n])


def test_bad_inputs_raise():
    graph = bpt_graph(5, 1)
    (q, k, v, rel), _, _ = inputs(graph, [5], torch.float32)
    with pytest.raises(ValueError, match="dropout_p"):
        graph_attention(q, k, v, graph, rel, dropout_p=1.0, backend="triton")
    with pytest.raises(RuntimeError, match="'triton' cannot run these inputs: dtypes"):
        graph_attention(q[..., :16], k[..., :16], v[..., :16], graph, rel[:, :16],
                        backend="triton")


def test_every_launch_runs_under_a_guard_for_its_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device: each launch makes its tensors' device
    current first (on CPU, the guard's argument is checked; a GPU test runs cuda:1)."""
    launches, guarded = [], []

    @contextlib.contextmanager
    def recording_guard(tensor):
        guarded.append(tensor.device)
        yield
        guarded.append(None)
    monkeypatch.setattr(triton_backend, "device_guard", recording_guard)
    for name in list(triton_backend.KERNELS):
        monkeypatch.setitem(triton_backend.KERNELS, name, GuardChecker(name, launches, guarded))
    graph = bpt_graph(9, 1)
    (q, k, v, rel), _, _ = inputs(graph, [9], torch.float32)
    graph_attention(q, k, v, graph, rel, backend="triton").sum().backward()
    assert launches == ["rel_table", "forward", "backward_query_rel_sums", "backward_query", "backward_key",
                        "rel_grad_partial", "rel_grad_sum"]  # (fp32: the sums in a launch of their own)


class GuardChecker(LaunchRecorder):
    def __init__(self, name, launches, guarded):
        super().__init__(name, launches)
        self.guarded = guarded

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            assert self.guarded and self.guarded[-1] == args[0].device  # inside the guard
            self.launches.append(self.name)
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_non_contiguous_inputs_match_the_reference():
    """Views as a model hands them over ([T, B, H, D] transposed to [B, H, T, D])."""
    graph = bpt_graph(12, 2)
    (q, k, v, rel), ref, mask = inputs(graph, [12, 7], torch.float32)
    views = [x.detach().permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3).requires_grad_()
             for x in (q, k, v)]
    assert not views[0].is_contiguous()
    out = graph_attention(*views, graph, rel, mask, backend="triton")
    expected = graph_attention(*ref[:3], graph, ref[3], mask, backend="torch")
    assert_close(out, expected, torch.float32, "output")
    grad = torch.randn(expected.shape)
    for actual, wanted in zip(torch.autograd.grad(out, views + [rel], grad),
                              torch.autograd.grad(expected, ref, grad.double())):
        assert_close(actual, wanted, torch.float32, "gradient")


def _strided_view(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The values of a contiguous [B, H, N, D] ``x`` in another memory layout: "time-first"
    (a [N, B, H, D] tensor permuted, what fairseq's split of heads hands over), "sliced"
    (every other head of a wider [B, N + 8, 2H, D] tensor, transposed: no dense layout),
    "odd-rows" (rows of D + 1 elements: strides the binaries are not compiled for, copied),
    "contiguous" (a copy)."""
    bsz, heads, nodes, dim = x.shape
    if layout == "contiguous":
        return x.clone()
    if layout == "time-first":
        view = x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    elif layout == "sliced":
        wide = torch.zeros(bsz, nodes + 8, 2 * heads, dim, dtype=x.dtype)
        view = wide[:, 4:4 + nodes, 1::2].transpose(1, 2)
        view.copy_(x)
    else:
        wide = torch.zeros(bsz, heads, nodes, dim + 1, dtype=x.dtype)
        view = wide[..., :dim]
        view.copy_(x)
    assert torch.equal(view, x) and not view.is_contiguous()
    return view


# layouts of (q and dO, k, v); "mixed": each tensor its own strides
STRIDED_CASES = {"time-first": ("time-first",) * 3, "sliced": ("sliced",) * 3,
                 "odd-rows": ("odd-rows",) * 3, "mixed": ("time-first", "sliced", "contiguous")}


@pytest.mark.parametrize("case", STRIDED_CASES)
def test_strided_views_give_bitwise_the_results_of_contiguous_copies(case, monkeypatch):
    """Two sentences x two heads (distinct batch and head strides), relative keys, padding,
    dropout and split blocks (one tile per program: the merges write strided outputs): the
    output and all four gradients are bitwise those of contiguous copies, and the output and
    the q/k/v gradients come back in their input's memory order (a time-first output is a
    time-first tensor, so fairseq's merge of heads reads it as a view); both match the
    float64 reference."""
    layouts = STRIDED_CASES[case]
    monkeypatch.setattr(tile_plan, "TILES_PER_ITEM", 1)
    graph = bpt_graph.__wrapped__(24, 1)  # a fresh graph: its plan is built with these splits
    plan = tile_plan.build_plan(graph, *triton_backend.tiles(torch.float32, 32))
    assert plan.query_work.num_parts and plan.key_work.num_parts
    (q, k, v, rel), ref, mask = inputs(graph, [24, 15], torch.float32, heads=2)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    results = []
    for strided in (False, True):
        def make(x, layout, strided=strided):
            return _strided_view(x.detach(), layout) if strided else x.detach().clone()
        leaves = [make(x, layout).requires_grad_() for x, layout in zip((q, k, v), layouts)]
        leaves.append(rel.detach().clone().requires_grad_())
        torch.manual_seed(5)
        out = triton_backend.attend(*leaves[:3], plan, leaves[3], mask, 32 ** -0.5, 0.2, dropout_seed("cpu", 0.2))
        grads = torch.autograd.grad(out, leaves, make(grad, layouts[0]))
        results.append((leaves, out, grads))
    (_, out, grads), (views, strided_out, strided_grads) = results
    torch.manual_seed(5)  # the kernels' seed: the first draw
    keep = keep_mask(int(torch.randint(0, 2**31 - 1, ())), 4, graph.num_nodes, 0.2)
    expected = dense_reference(*ref[:3], graph, ref[3], mask, 32 ** -0.5, keep, 0.2)
    assert_close(out, expected, torch.float32, "output")
    for name, actual, wanted in zip(("q", "k", "v", "rel_key"), grads,
                                    torch.autograd.grad(expected, ref, grad.double())):
        assert_close(actual, wanted, torch.float32, f"grad {name}")
    assert torch.equal(strided_out, out)
    for name, actual, expected in zip(("q", "k", "v", "rel_key"), strided_grads, grads):
        assert torch.equal(actual, expected), f"grad {name}"

    def order(x):
        return sorted(range(4), key=lambda dim: -x.stride(dim))
    if case != "odd-rows":  # (copied: the outputs are contiguous)
        assert order(strided_out) == order(views[0])
        assert [order(g) for g in strided_grads[:3]] == [order(x) for x in views[:3]]
    if layouts[0] == "time-first":
        assert strided_out.permute(2, 0, 1, 3).is_contiguous()


@pytest.mark.parametrize("split", [False, True], ids=["whole-blocks", "split-blocks"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_dq_is_written_in_the_input_dtype_with_float32_relative_keys(dtype, split, monkeypatch):
    """fp16/bf16 q, k, v with an fp32 rel_key (autocast's case): the dQ kernel writes dQ in
    the input dtype, its relative-key term added in fp32 before the one rounding (in the
    kernel for whole blocks, in the merge for split ones); every gradient matches float64
    and has its leaf's dtype."""
    launches = []
    monkeypatch.setitem(triton_backend.KERNELS, "backward_query",
                        LaunchRecorder("backward_query", launches))
    if split:
        monkeypatch.setattr(tile_plan, "TILES_PER_ITEM", 1)
    graph = bpt_graph.__wrapped__(40, 2)  # a fresh graph: its plan is built with these splits
    plan = tile_plan.build_plan(graph, *triton_backend.tiles(dtype, 32))
    assert bool(plan.query_work.num_parts) == split
    low, ref, mask = inputs(graph, [40, 23], dtype, heads=2)
    gen = torch.Generator().manual_seed(4)
    rel = (ref[3].detach() + 1e-3 * torch.randn(ref[3].shape, generator=gen, dtype=torch.float64)).float()
    low[3], ref[3] = rel.requires_grad_(), rel.detach().double().requires_grad_()
    out = triton_backend.attend(*low[:3], plan, low[3], mask, 32 ** -0.5, 0.0)
    expected = graph_attention(*ref[:3], graph, ref[3], mask, backend="torch")
    assert_close(out, expected, dtype, "output")
    grad = torch.randn(expected.shape, generator=gen)
    grads = torch.autograd.grad(out, low, grad.to(dtype))
    for name, actual, wanted, leaf in zip(("q", "k", "v", "rel_key"), grads,
                                          torch.autograd.grad(expected, ref, grad.double()), low):
        assert actual.dtype == leaf.dtype, name
        assert_close(actual, wanted, dtype, f"grad {name}")
    (_, args, _), = launches
    assert args[7].dtype == dtype  # grad_q_ptr: the kernel writes dQ in the input dtype


def test_dq_under_cpu_autocast_with_split_blocks(monkeypatch):
    """fairseq's --amp: fp32 leaves under CPU autocast (fp16 here; bf16 in
    ``test_graph_attention_autocast``), split query blocks, against float64."""
    from tests.graph_attention.test_graph_attention_autocast import check_under_autocast
    monkeypatch.setattr(tile_plan, "TILES_PER_ITEM", 1)
    graph = bpt_graph.__wrapped__(24, 2)
    assert tile_plan.build_plan(graph, *triton_backend.tiles(torch.float16, 32)).query_work.num_parts
    check_under_autocast("triton", graph, [24, 13], torch.float16)


def test_dropout_beyond_the_hash_limit_is_refused_so_auto_falls_back():
    from fairseq_plugins.graphs.attention_graph import AttentionGraph
    n = triton_backend.MAX_DROPOUT_NODES + 1
    graph = AttentionGraph(n, torch.arange(n + 1), torch.arange(n), torch.zeros(n, dtype=torch.long), 1)
    q = torch.zeros(1, 1, n, 32)
    assert "at most 65535 nodes" in triton_backend.refuses(q, graph, 0.1)
    assert triton_backend.refuses(q, graph, 0.0) is None


def test_the_self_check_graph_splits_every_kernels_work():
    """What training at length runs: split query blocks and key blocks for every Triton
    configuration, split rows for the CUDA kernels (BPT has no key read by over 256 queries)."""
    from fairseq_plugins.graph_attention import cuda_backend, registry
    graph = registry.SELF_CHECK_GRAPH()
    for (kernel, dtype, dim), config in triton_backend.CONFIGS.items():
        if kernel == "forward":
            plan = tile_plan.build_plan(graph, config.block_m, config.block_n)
            assert plan.query_work.num_parts and plan.key_work.num_parts, (dtype, dim)
    assert cuda_backend.kernel_plan(graph).by_query.num_slots > 0


@pytest.fixture
def small_self_check(monkeypatch):
    """The self-check on a graph the interpreter runs in seconds, with blocks of at most two
    tiles, so that it still splits query and key blocks."""
    from fairseq_plugins.graph_attention import registry
    monkeypatch.setattr(registry, "SELF_CHECK_TOKENS", 40)
    # a fresh graph (bpt_graph's are shared): its plan is built here, with these splits
    monkeypatch.setattr(registry, "SELF_CHECK_GRAPH", lambda: bpt_graph.__wrapped__(40, 1))
    monkeypatch.setattr(tile_plan, "TILES_PER_ITEM", 2)
    plan = tile_plan.build_plan(bpt_graph(40, 1), *triton_backend.tiles(torch.float32, 32))
    assert plan.query_work.num_parts and plan.key_work.num_parts
    return lambda: registry.self_check(triton_backend.BACKEND, "cpu", torch.float32, 32)  # as the op calls it


def test_the_self_check_passes_the_kernels(small_self_check):
    small_self_check()


class FirstPartOnly(LaunchRecorder):
    """The forward merge kernel, launched with a ``part_index`` that lists only each split
    block's first part (the others read as padding): a merge that drops parts."""

    def __getitem__(self, grid):
        names = self.kernel.arg_names

        def launch(*args, **kwargs):
            args = list(args)
            index, num_parts = args[names.index("part_index_ptr")], args[names.index("num_parts")]
            first = torch.full_like(index, num_parts)
            first[:, 0] = index[:, 0]
            args[names.index("part_index_ptr")] = first
            self.launches.append(self.name)
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_the_self_check_catches_a_split_block_merge_bug(small_self_check, monkeypatch):
    launches = []
    monkeypatch.setitem(triton_backend.KERNELS, "merge_forward", FirstPartOnly("merge_forward", launches))
    with pytest.raises(RuntimeError, match="output differs"):
        small_self_check()
    assert launches


def test_the_self_check_catches_a_backward_that_redraws_the_dropout_mask(small_self_check, monkeypatch):
    original = triton_backend.backward_op

    def another_mask(*args):
        *head, seed = args
        return original(*head, None if seed is None else seed + 1)  # (None: no dropout)
    monkeypatch.setattr(triton_backend, "backward_op", another_mask)
    with pytest.raises(RuntimeError, match="the backward's mask is not the forward's"):
        small_self_check()


def test_the_self_check_catches_dropout_without_its_rescaling(small_self_check, monkeypatch):
    scalars = triton_backend._scalars

    def no_rescaling(*args):  # kept probabilities not divided by 1 - p
        variant, (*head, _) = scalars(*args)
        return variant, (*head, 1.0)
    monkeypatch.setattr(triton_backend, "_scalars", no_rescaling)
    with pytest.raises(RuntimeError, match="kept probability mass"):
        small_self_check()


def offsets_beyond_int32_case(layout: str):
    """5 heads x nodes x dim of 5 x 2^30 elements (10 GiB of fp16, allocated but never touched
    but for the rows the plan reads: the pages stay virtual) in one of two layouts: "heads"
    ([1, 5, N, D] contiguous: the later heads start past 2^31 and 2^32 elements) or
    "time-first" (a [N, 1, 5, D] tensor viewed as [1, 5, N, D], fairseq's layout: the last
    nodes' rows start past 2^32 elements). A small graph's plan is moved to the last nodes;
    the forward there matches the float64 reference computed on those rows alone. Raises
    AssertionError on a mismatch; an int32 offset wraps to an address outside the tensor and
    crashes the process (a GPU's illegal memory access)."""
    small = bpt_graph(32, 2)
    block_m, block_n = triton_backend.tiles(torch.float16, 32)
    plan = tile_plan.build_plan(small, block_m, block_n)
    assert not plan.query_work.num_parts and not plan.key_work.num_parts
    shift, heads, dim = 2**25 + 2**15, 5, 32  # 2^25 + 2^15 nodes of 32: 2^30 + 2^20
    num_nodes = shift + small.num_nodes
    key_items = plan.key_work.items.clone()
    key_items[:, 0] += shift // block_m  # aligned key blocks: shift is a multiple of block_m
    moved = tile_plan.TilePlan(
        block_m, block_n, num_nodes, torch.where(plan.slot_node >= 0, plan.slot_node + shift, -1),
        plan.tile_start + shift, plan.tile_types, plan.tile_type_start, plan.tile_type_ids,
        plan.query_work, plan.window_start, plan.window_types,
        dataclasses.replace(plan.key_work, items=key_items))
    if layout == "heads":
        qkv = torch.empty(1, heads, num_nodes, dim, dtype=torch.float16)  # q = k = v
        assert (heads - 1) * qkv.stride(1) > 2**32
    else:
        qkv = torch.empty(num_nodes, 1, heads, dim, dtype=torch.float16).permute(1, 2, 0, 3)
        assert shift * qkv.stride(2) > 2**32 and qkv.stride(2) == heads * dim
    rows = slice(shift, num_nodes)
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(1, heads, small.num_nodes, dim, generator=gen).to(torch.float16)
    qkv[:, :, rows] = values
    pad = torch.zeros(1, num_nodes, dtype=torch.uint8)
    out, _, _ = triton_backend.forward_op(qkv, qkv, qkv, None, pad, list(moved.tensors()),
                                          list(moved.sizes()), dim ** -0.5, 0.0,
                                          torch.zeros((), dtype=torch.int64))
    assert out.stride()[1:] == qkv.stride()[1:]  # in the input's layout (B = 1: any stride)
    x = values.double()
    expected = graph_attention(x, x, x, small, backend="torch")
    assert_close(out[:, :, rows], expected, torch.float16, f"output ({layout})")


@pytest.mark.parametrize("layout", ["heads", "time-first"])
def test_offsets_beyond_2_to_the_31_elements_are_computed_in_int64(layout):
    """``offsets_beyond_int32_case`` in a process of its own (a wrong offset crashes it)."""
    import subprocess
    import sys
    command = f"from tests.graph_attention.test_triton_backend import offsets_beyond_int32_case as c; c({layout!r})"
    result = subprocess.run([sys.executable, "-c", command], cwd=REPO,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                            text=True, timeout=300)
    if "Cannot allocate memory" in result.stderr or "DefaultCPUAllocator" in result.stderr:
        pytest.skip("the OS refuses 10 GiB of address space here")
    assert result.returncode == 0, f"exit status {result.returncode}: {result.stderr[-3000:]}"
