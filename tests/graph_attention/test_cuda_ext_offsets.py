"""The CUDA kernels' element offsets are 64-bit: under the host emulation, a small graph placed
at the end of tensors of more than 2^32 elements (B * H * N * D, fp16) gives bit for bit
what it gives at the start of small tensors: forward (out, lse), backward (dQ, dK, dV and the
per-type dS sums) with split rows, padding, relative keys and dropout. Offsets computed in 32
bits would wrap, read other rows or memory outside the tensors, and differ or crash.

The big tensors are never filled: ``torch.empty`` reserves them and only the rows the kernels
touch are written (a few pages). The bare launchers run on the hand-placed work schedule, so
only the placed rows are visited; the comparison runs in a subprocess, so that a wrapped
offset that crashes fails this test instead of ending pytest."""

import subprocess
import sys

import pytest
import torch

from fairseq_plugins.check_gpu.cases import random_graph
from fairseq_plugins.graph_attention import cuda_backend
from tests.cli import REPO

BATCH, HEADS, DIM = 2, 1, 32
# (BATCH * HEADS) * NODES * DIM > 2^32: the last sentence's rows start past 2^32 elements,
# the first one's last rows past 2^31
NODES = 2**26 + 2**16
SPLIT = 2  # the small graph's longer rows are split: the merge kernels and their workspaces run
DROPOUT = 0.25


def _placed(plan: "cuda_backend.KernelPlan", place: torch.Tensor):
    """The plan's tensors with node ids mapped through ``place`` (edge positions unchanged)."""
    def rows(table):
        table = table.clone()
        table[:, 0] = place[table[:, 0].long()].to(torch.int32)
        return table
    return (place[plan.indices.long()].to(torch.int32), plan.edge_type, rows(plan.by_query.pieces),
            rows(plan.by_query.merges), plan.by_query.num_slots, place[plan.t_query.long()].to(torch.int32),
            plan.t_edge, rows(plan.by_key.pieces), rows(plan.by_key.merges), plan.by_key.num_slots)


def _run(emulation, nodes, plan_args, inputs, rel, kpm, rng, lse_delta=None):
    """Forward, then backward, through the bare launchers; outputs allocated unfilled."""
    indices, edge_type, q_pieces, q_merges, q_slots, t_query, t_edge, k_pieces, k_merges, k_slots = plan_args
    q, k, v, grad_out = inputs
    shape = (BATCH, HEADS, nodes, DIM)
    out, grad_q, grad_k, grad_v = (torch.empty(shape, dtype=q.dtype) for _ in range(4))
    lse = torch.empty(BATCH, HEADS, nodes)
    scale = DIM**-0.5
    emulation.launch_forward(q, k, v, rel, indices, edge_type, q_pieces, q_merges, q_slots, kpm, scale, DROPOUT,
                             rng, out, lse)
    delta = torch.empty(BATCH, HEADS, nodes) if lse_delta is None else lse_delta
    type_sums = torch.empty(BATCH * HEADS * nodes, rel.size(0))
    return out, lse, delta, type_sums, (grad_q, grad_k, grad_v), lambda: emulation.launch_backward(
        grad_out, q, k, v, rel, lse, delta, indices, edge_type, q_pieces, q_merges, q_slots, t_query, t_edge,
        k_pieces, k_merges, k_slots, kpm, scale, DROPOUT, rng, grad_q, grad_k, grad_v, type_sums)


def compare_at_large_offsets():
    """Exit status 0 when the placed run equals the small one, else a message (subprocess)."""
    from tests.cuda_ext_emulation import load_emulation

    emulation = load_emulation()
    graph = random_graph(8, 3, 3, seed=1)  # multi-type rows, split rows, an empty row
    plan = cuda_backend.kernel_plan(graph, SPLIT)
    assert plan.by_query.merges.size(0) and plan.by_key.merges.size(0)
    # the small graph's nodes at the end of the big tensors, and one near the start
    place = torch.tensor([NODES - 1, NODES - 2, 5, NODES - 4, NODES - 9, NODES - 16, NODES - 17, NODES - 300])
    gen = torch.Generator().manual_seed(0)
    small = [torch.randn(BATCH, HEADS, graph.num_nodes, DIM, generator=gen).half() for _ in range(4)]
    rel = (0.5 * torch.randn(graph.num_edge_types, DIM, generator=gen)).half()
    kpm = torch.zeros(BATCH, graph.num_nodes, dtype=torch.bool)
    kpm[1, 3] = True
    rng = torch.tensor([0x1234_5678_9ABC_DEF0, 2**40 + 7])

    out, lse, delta, type_sums, grads, backward = _run(
        emulation, graph.num_nodes, _placed(plan, torch.arange(graph.num_nodes)), small, rel, kpm, rng)
    delta.copy_((small[3].float() * out.float()).sum(-1))
    type_sums.zero_()
    backward()

    try:
        big = [torch.empty(BATCH, HEADS, NODES, DIM, dtype=torch.float16) for _ in range(4)]
        big_kpm = torch.empty(BATCH, NODES, dtype=torch.bool)
    except RuntimeError as error:  # an allocator that reserves nothing lazily
        return f"SKIP cannot reserve the big tensors: {error}"
    for b, s in zip(big, small):
        b[:, :, place] = s
    big_kpm[:, place] = kpm
    big_delta = torch.empty(BATCH, HEADS, NODES)
    big_delta[:, :, place] = delta
    out_b, lse_b, _, sums_b, grads_b, backward_b = _run(emulation, NODES, _placed(plan, place), big, rel,
                                                         big_kpm, rng, big_delta)
    sums_b.view(BATCH * HEADS, NODES, -1)[:, place] = 0
    backward_b()
    flat = (torch.arange(BATCH * HEADS)[:, None] * NODES + place).flatten()
    pairs = [("out", out, out_b[:, :, place]), ("lse", lse, lse_b[:, :, place]),
             ("type sums", type_sums, sums_b[flat])]
    pairs += [(name, g, gb[:, :, place]) for name, g, gb in zip(("dq", "dk", "dv"), grads, grads_b)]
    for name, expected, actual in pairs:
        if not torch.equal(actual, expected):
            return f"{name} differs at large offsets: max difference {(actual.float() - expected.float()).abs().max()}"
    if not (out.abs().max() > 0 and type_sums.abs().max() > 0 and grads[2].abs().max() > 0):
        return "the small run computed nothing to compare"
    return None


def test_offsets_beyond_two_to_the_32_elements():
    from tests.cuda_ext_emulation import load_emulation

    load_emulation()  # built here (or skipped), so that the subprocess only loads it
    script = "import sys, tests.graph_attention.test_cuda_ext_offsets as t; r = t.compare_at_large_offsets(); " \
             "print(r or 'ok'); sys.exit(0 if r is None or r.startswith('SKIP') else 1)"
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    report = (result.stdout + result.stderr).strip()
    if result.returncode == 0 and report.splitlines()[-1].startswith("SKIP"):
        pytest.skip(report.splitlines()[-1])
    assert result.returncode == 0 and report.splitlines()[-1] == "ok", (
        f"exit status {result.returncode}:\n{report[-3000:]}")
