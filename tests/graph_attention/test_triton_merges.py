"""The merge kernels of split blocks (``triton_kernels.merge_*_kernel``, under the Triton
interpreter) against the torch merges they replaced, kept here as the reference.

Random parts over real plans (BPT, one or two tiles per program, so that blocks have
different part counts and ``part_index`` is padded), parts without keys (lse -inf) and
rows without any key (every part -inf), fp32/fp16/bf16 targets in the contiguous and the
time-first layout (fairseq's), relative-key terms of dQ's split rows. Rows that are not in
a split block are left as they were. The full op with split blocks against float64 is in
``test_triton_backend`` (dropout, strided views, dQ in half precision).
"""

import pytest
import torch

pytest.importorskip("triton")
from fairseq_plugins.graph_attention import tile_plan, triton_backend  # noqa: E402
from fairseq_plugins.graphs.binary_partition import bpt_graph  # noqa: E402

from tests.triton_interpreter import skip_reason  # noqa: E402

pytestmark = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason())

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BSZ, HEADS, DIM = 2, 2, 32

# ------------------------------------------------------------------ the torch reference


def _gather_parts(parts: torch.Tensor, work: tile_plan.WorkItems, fill=0.0) -> torch.Tensor:
    """[S, max parts, BH, rows, ...] parts of each split block (``fill`` where padded)."""
    return torch.cat([parts, parts.new_full((1, *parts.shape[1:]), fill)])[work.part_index.long()]


def _scatter_rows(target, values, work: tile_plan.WorkItems, term=None) -> None:
    """target[..., node, ...] = values[s, bh, r] (+ ``term(nodes)`` [BH, nodes, ...] before
    the cast to target's dtype) for the split blocks' rows that are nodes; ``target`` is
    [BH, N] (``values`` [S, BH, rows]) or [B, H, N, D] in any memory order (``values``
    [S, BH, rows, D])."""
    rows = work.split_nodes.flatten().long()
    positions, nodes = torch.nonzero(rows >= 0).flatten(), rows[rows >= 0]
    flat = values.transpose(0, 1).flatten(1, 2)[:, positions]  # [BH, split rows, ...]
    if term is not None:
        flat = flat + term(nodes)
    node_dim = target.dim() - values.dim() + 2
    flat = flat.reshape(*target.shape[:node_dim], *flat.shape[1:])
    target[(slice(None),) * node_dim + (nodes,)] = flat.to(target.dtype)


def reference_merge_forward(out, lse, part_out, part_lse, work) -> None:
    """By log-sum-exp (a part without keys: -inf); rows without any key get lse = +inf."""
    lses = _gather_parts(part_lse, work, float("-inf"))  # [S, parts, BH, BLOCK_M]
    total = torch.logsumexp(lses, 1)
    no_key = torch.isinf(total)
    weights = torch.exp(lses - torch.where(no_key, 0.0, total)[:, None])
    _scatter_rows(out, (weights[..., None] * _gather_parts(part_out, work)).sum(1), work)
    _scatter_rows(lse, torch.where(no_key, float("inf"), total), work)


def reference_merge_sum(target, parts, work, term=None) -> None:
    """The parts' sum, plus ``term(nodes)`` (fp32 [BH, nodes, D]) if given, rounded once."""
    _scatter_rows(target, _gather_parts(parts, work).sum(1), work, term)


# ------------------------------------------------------------------ cases


def split_plan(dtype, tiles_per_item=1, tokens=40, k=1, dim=DIM):
    """A plan whose blocks of more than ``tiles_per_item`` tiles are split, at the tile size
    that the kernels of ``dtype`` and ``dim`` run; a fresh graph (``bpt_graph``'s are shared)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tile_plan, "TILES_PER_ITEM", tiles_per_item)
        graph = bpt_graph.__wrapped__(tokens, k)
        plan = tile_plan.build_plan(graph, *triton_backend.tiles(dtype, dim))
    for work in (plan.query_work, plan.key_work):
        assert work.num_parts and bool((work.part_index == work.num_parts).any()), "no padded part"
    return graph, plan


def target(num_nodes, dtype, layout, fill=7.0, dim=DIM):
    """[BSZ, HEADS, N, dim] filled with ``fill`` (rows the merge must not touch), contiguous
    or a view of a time-first [N, BSZ, HEADS, dim] tensor."""
    if layout == "time-first":
        return torch.full((num_nodes, BSZ, HEADS, dim), fill, dtype=dtype).permute(1, 2, 0, 3)
    return torch.full((BSZ, HEADS, num_nodes, dim), fill, dtype=dtype)


def parts(work, block_m, gen, dim=DIM):
    return torch.randn(work.num_parts, BSZ * HEADS, block_m, dim, generator=gen)


def forward_parts(work, block_m, gen):
    """(part_out, part_lse) as the forward kernel writes them: about a third of the (part,
    row) pairs without keys (lse -inf, output 0), and the first split block's first 3 rows
    without a key in any part."""
    part_out = parts(work, block_m, gen)
    part_lse = 3 * torch.randn(work.num_parts, BSZ * HEADS, block_m, generator=gen)
    part_lse[torch.rand(part_lse.shape, generator=gen) < 0.3] = float("-inf")
    first = work.part_index[0]
    part_lse[first[first < work.num_parts].long(), :, :3] = float("-inf")
    part_out[torch.isinf(part_lse)] = 0.0
    return part_out, part_lse


def assert_same(actual, expected):
    """Equal up to fp32 rounding, then the target dtype's (one unit in its last place)."""
    torch.testing.assert_close(actual, expected, rtol=1e-5 if actual.dtype == torch.float32 else None,
                               atol=1e-6 if actual.dtype == torch.float32 else None)


LAYOUTS = ["contiguous", "time-first"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_forward_merge_matches_the_reference(dtype, layout):
    graph, plan = split_plan(dtype)
    work, n = plan.query_work, graph.num_nodes
    part_out, part_lse = forward_parts(work, plan.block_m, torch.Generator().manual_seed(0))
    results = []
    for merge in (triton_backend.merge_forward, reference_merge_forward):
        out, lse = target(n, dtype, layout), torch.full((BSZ * HEADS, n), 7.0)
        merge(out, lse, part_out, part_lse, work)
        results.append((out, lse))
    (out, lse), (expected_out, expected_lse) = results
    assert_same(out, expected_out)
    assert_same(lse, expected_lse)
    no_key = work.split_nodes[0, :3].long()
    assert bool((out[:, :, no_key] == 0).all()) and bool((lse[:, no_key] == float("inf")).all())
    merged = torch.zeros(n, dtype=torch.bool)
    merged[work.split_nodes[work.split_nodes >= 0].long()] = True
    assert bool((out[:, :, ~merged] == 7).all()) and bool((lse[:, ~merged] == 7).all())
    assert bool(torch.isfinite(lse[:, merged]).any())


@pytest.mark.parametrize("with_rel", [True, False], ids=["rel_key", "no_rel_key"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dim", [DIM, 128])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_dq_merge_matches_the_reference(dtype, dim, layout, with_rel):
    """The parts' fp32 sum, rounded once; with relative keys also the split rows'
    per-(row, type) sums: the parts' own rows behind the [BH, N, T] sums
    (``triton_kernels._type_sums_rows``), summed in the plan's order, other rows untouched;
    for fp16/bf16 the merge adds dQ's relative-key term from the merged sums before the
    rounding (fp32 dQ gets it after the kernels), at head dim 128 too (where the sums have a
    launch of their own, ``splits_rel_sums``)."""
    graph, plan = split_plan(dtype, dim=dim)
    work, n = plan.query_work, graph.num_nodes
    gen = torch.Generator().manual_seed(1)
    part_grad_q = parts(work, plan.block_m, gen, dim=dim)
    num_types = graph.num_edge_types if with_rel else 0
    part_sums = parts(work, plan.block_m, gen, dim=max(num_types, 1))
    type_sums = torch.cat([torch.full((BSZ * HEADS * n * max(num_types, 1),), 7.0), part_sums.flatten()])
    rel_key = torch.randn(max(num_types, 1), dim, generator=gen)
    grad_q, expected = target(n, dtype, layout, dim=dim), target(n, dtype, layout, dim=dim)
    triton_backend.merge_grad_q(grad_q, part_grad_q, work, type_sums, rel_key, num_types)
    adds_term = with_rel and dtype != torch.float32

    def term(nodes):  # the relative-key term of these nodes from their merged sums, fp32 [BH, nodes, D]
        merged = torch.zeros(BSZ * HEADS, n, num_types)
        reference_merge_sum(merged, part_sums, work)
        return merged[:, nodes] @ rel_key

    reference_merge_sum(expected, part_grad_q, work, term if adds_term else None)
    assert_same(grad_q, expected)
    if adds_term:  # the term is not negligible next to the parts' sum
        without = target(n, dtype, layout, dim=dim)
        reference_merge_sum(without, part_grad_q, work)
        assert (without.float() - expected.float()).abs().max() > 1
    merged = type_sums[:BSZ * HEADS * n * max(num_types, 1)].view(BSZ * HEADS, n, -1)
    expected_sums = torch.full_like(merged, 7.0)
    if with_rel:
        reference_merge_sum(expected_sums, part_sums, work)
    assert_same(merged, expected_sums)
    assert_same(type_sums[merged.numel():], part_sums.flatten())  # the parts are read only


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_dk_dv_merge_matches_the_reference(dtype, layout):
    """One launch for both; split key blocks (aligned blocks of keys, the last one partly
    past the graph's nodes)."""
    graph, plan = split_plan(dtype, tokens=70)
    work, n = plan.key_work, graph.num_nodes
    assert bool((work.split_nodes < 0).any())
    gen = torch.Generator().manual_seed(2)
    part_grad_k, part_grad_v = parts(work, plan.block_m, gen), parts(work, plan.block_m, gen)
    grad_k, grad_v = target(n, dtype, layout), target(n, dtype, "contiguous")
    triton_backend.merge_grad_kv(grad_k, grad_v, part_grad_k, part_grad_v, work)
    for actual, part in ((grad_k, part_grad_k), (grad_v, part_grad_v)):
        expected = target(n, dtype, layout if actual is grad_k else "contiguous")
        reference_merge_sum(expected, part, work)
        assert_same(actual, expected)


def test_a_plan_without_split_blocks_launches_no_merge(monkeypatch):
    launches = []
    monkeypatch.setattr(triton_backend, "_launch", lambda *args: launches.append(args))
    graph = bpt_graph(17, 1)
    plan = tile_plan.build_plan(graph, *triton_backend.tiles(torch.float32, DIM))
    assert not plan.query_work.num_parts and not plan.key_work.num_parts
    out = target(graph.num_nodes, torch.float32, "contiguous")
    empty = torch.empty(0, BSZ * HEADS, plan.block_m, DIM)
    triton_backend.merge_forward(out, torch.empty(BSZ * HEADS, graph.num_nodes), empty, empty[..., 0],
                                 plan.query_work)
    triton_backend.merge_grad_kv(out, out, empty, empty, plan.key_work)
    assert not launches and bool((out == 7).all())


@pytest.mark.parametrize("per_item", [1, 3, None])
def test_work_items_run_longest_first(per_item, monkeypatch):
    """Both sides' items in non-increasing tile counts (the GPU starts programs in grid order:
    the root's long rows do not run alone at the end), every tile in exactly one item."""
    if per_item:
        monkeypatch.setattr(tile_plan, "TILES_PER_ITEM", per_item)
    plan = tile_plan.build_plan(bpt_graph.__wrapped__(300, 2), 64, 32)
    for work, num_tiles in ((plan.query_work, plan.tile_start.numel()), (plan.key_work, plan.window_start.numel())):
        _, begin, end, _ = work.items.long().unbind(1)
        lengths = end - begin
        assert bool((lengths[:-1] >= lengths[1:]).all()) and (per_item == 1 or lengths[0] > lengths[-1])
        covered = torch.zeros(num_tiles, dtype=torch.long)
        for lo, hi in zip(begin.tolist(), end.tolist()):
            covered[lo:hi] += 1
        assert bool((covered == 1).all())


def test_the_tiles_list_every_edge_type_they_hold():
    """The dQ kernel sums d(score) per (row, type) over the types a tile lists: each tile's
    list is exactly its types, ascending (a missing type would drop its gradient)."""
    plan = tile_plan.build_plan(bpt_graph.__wrapped__(300, 2), 64, 32)
    start, ids = plan.tile_type_start.long(), plan.tile_type_ids.long()
    assert start[0] == 0 and start[-1] == ids.numel() == start.numel() - 1 + int((start[1:] - start[:-1] - 1).sum())
    for tile in range(plan.num_tiles):
        present = torch.unique(plan.tile_types[tile].long())
        assert ids[start[tile]:start[tile + 1]].tolist() == present[present >= 0].tolist()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gradients_do_not_depend_on_the_order_programs_run(dtype):
    """Split blocks, relative keys: the work items in the plan's order and reversed (a GPU
    runs programs in any order) give the same bits of dQ, dK, dV and d rel_key: no atomics,
    every sum in a fixed order (fp32 atomics of the per-(row, type) sums differed)."""
    import dataclasses

    graph, plan = split_plan(dtype)
    reverse = dataclasses.replace(plan, query_work=dataclasses.replace(
        plan.query_work, items=plan.query_work.items.flip(0)), key_work=dataclasses.replace(
        plan.key_work, items=plan.key_work.items.flip(0)))
    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn(BSZ, HEADS, graph.num_nodes, DIM, generator=gen).to(dtype) for _ in range(3)]
    leaves.append(torch.randn(graph.num_edge_types, DIM, generator=gen))
    grad_out = torch.randn(BSZ, HEADS, graph.num_nodes, DIM, generator=gen).to(dtype)
    grads = []
    for order in (plan, reverse):
        inputs = [x.clone().requires_grad_() for x in leaves]
        out = triton_backend.attend(*inputs[:3], order, inputs[3], None, DIM ** -0.5, 0.0)
        out.backward(grad_out)
        grads.append([x.grad for x in inputs])
    for first, second in zip(*grads):
        assert torch.equal(first, second)
    assert grads[0][3].abs().sum() > 0
