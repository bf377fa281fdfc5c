"""The triton backend rounds like a GPU under the Triton interpreter (CPU): P and dS are
rounded to the input dtype (to nearest even) right before their products, and the stored
rows once, exactly where the compiled kernels round them; under CPU autocast to bf16 too.

On a graph whose every query row reads one key tile (so the online softmax's running max is
the row's max from the first tile on), a float64 emulation of those roundings predicts the
kernels' fp16/bf16 results up to the last place: the output and every gradient agree with it
to one unit in the last place in all but a few elements (near-ties: the kernels' exp and
sums are fp32), while the same emulation without P's and dS's roundings misses many more.
Checked by hand: an extra rounding of P (the row sum taken over rounded P) fails every case,
a missing rounding of dS (bf16) fails dQ.
"""

import pytest
import torch

pytest.importorskip("triton")
from fairseq_plugins.graph_attention import graph_attention, tile_plan, triton_backend  # noqa: E402
from fairseq_plugins.graphs.binary_partition import bpt_graph  # noqa: E402

from tests.graph_attention.test_triton_backend import inputs  # noqa: E402
from tests.triton_interpreter import skip_reason  # noqa: E402

pytestmark = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason())

DIM = 32


def emulated(q, k, v, rel_key, graph, mask, grad, dtype, rounded=True, rel_dtype=None):
    """float64 forward and gradients with the kernels' roundings to ``dtype`` (P and dS
    before their products when ``rounded``; the output, dQ, dK, dV always, d rel_key to
    ``rel_dtype``, default ``dtype``): (out, grad q, grad k, grad v, grad rel_key)."""
    def r(x, to=dtype):
        return x.to(to).double()

    def operand(x):
        return r(x) if rounded else x

    n, scale = graph.num_nodes, DIM ** -0.5
    types = torch.full((n, n), -1, dtype=torch.long)
    types[graph.rows(), graph.indices] = graph.edge_type
    valid = (types >= 0) & ~mask[:, None, None, :]
    qr = q @ rel_key.T  # [B, H, N, T]
    s = (q @ k.transpose(-1, -2) + torch.gather(qr, -1, types.clamp(min=0).expand(*q.shape[:2], n, n))) * scale
    s = s.masked_fill(~valid, float("-inf"))
    m = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    p = torch.exp(s - m)
    l_sum = p.sum(-1, keepdim=True)
    out = r(operand(p) @ v / l_sum.clamp(min=1e-300))
    p = p / l_sum.clamp(min=1e-300)  # the backward's P, from the log-sum-exp
    grad_p = grad @ v.transpose(-1, -2)
    delta = (grad * out).sum(-1, keepdim=True)
    grad_s = p * (grad_p - delta)
    per_type = torch.zeros(*q.shape[:3], rel_key.size(0), dtype=torch.float64)
    per_type.scatter_add_(-1, types.clamp(min=0).expand_as(grad_s), grad_s * valid)
    grad_q = r(scale * (operand(grad_s) @ k + per_type @ rel_key))
    grad_k = r(scale * operand(grad_s).transpose(-1, -2) @ q)
    grad_v = r(operand(p).transpose(-1, -2) @ grad)
    grad_rel = r(scale * torch.einsum("bhnt,bhnd->td", per_type, q), rel_dtype or dtype)
    return out, grad_q, grad_k, grad_v, grad_rel


def misses(actual, expected, dtype):
    """(share of elements that differ, largest difference in units of the last place);
    differences below 2^-12 of the largest value (fp32 noise, e.g. where the emulation's
    d(score) cancels to exactly 0) are not counted."""
    actual = actual.detach().double()
    floor = 2.0 ** -12 * float(expected.abs().max())
    magnitude = expected.abs().clamp(min=floor)
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(magnitude)))
    differ = (actual - expected).abs() > floor
    return float(differ.double().mean()), float(((actual - expected).abs() * differ / ulp).max())


@pytest.mark.parametrize("split", [False, True], ids=["whole-blocks", "split-blocks"])
@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)],
                         ids=["bf16", "fp16", "fp32-under-bf16-autocast"])
def test_p_and_ds_are_rounded_where_a_gpu_rounds_them(dtype, autocast, split, monkeypatch):
    """Forward and every gradient against the emulation, relative keys and padding, whole
    blocks and (one tile per program) split key blocks; inputs in ``dtype``, or fp32 leaves
    under CPU autocast to bf16 (a model's parameters: the op runs in bf16, rel_key and every
    gradient stay fp32)."""
    if split:
        monkeypatch.setattr(tile_plan, "TILES_PER_ITEM", 1)
    graph = bpt_graph.__wrapped__(8, 2)  # a fresh graph: its plan is built with these splits
    plan = tile_plan.plan_on(graph, *triton_backend.tiles(dtype, DIM), "cpu")
    assert graph.num_nodes <= plan.block_n and plan.num_tiles == plan.slot_node.numel() // plan.block_m
    assert bool(plan.key_work.num_parts) == split
    low, _, mask = inputs(graph, [8, 5], dtype, DIM, heads=2)
    if autocast:  # fp32 leaves holding the same (bf16-exact) values
        low = [x.detach().float().requires_grad_() for x in low]
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        out = graph_attention(*low[:3], graph, low[3], mask, backend="triton")
        assert out.dtype == dtype
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
        actual = (out, *torch.autograd.grad(out, low, grad))
    exact = [x.detach().double() for x in low]
    names = ("output", "grad q", "grad k", "grad v", "grad rel_key")
    rel_dtype = low[3].dtype
    gpu = emulated(*exact[:3], exact[3], graph, mask, grad.double(), dtype, rel_dtype=rel_dtype)
    unrounded = emulated(*exact[:3], exact[3], graph, mask, grad.double(), dtype, rounded=False,
                         rel_dtype=rel_dtype)
    near, far = 0.0, 0.0  # shares of elements that differ, summed over the tensors
    for name, a, e, u in zip(names, actual, gpu, unrounded):
        share, worst = misses(a, e, dtype)
        assert share <= 0.02 and worst <= 1.0, f"{name}: {share:.1%} differ, up to {worst:.2f} ulp"
        near, far = near + share, far + misses(a, u, dtype)[0]
    # the roundings matter: without them the emulation misses many more elements (bf16:
    # about 30% of each tensor's, fp16: about 0.5%, where the kernels miss none)
    assert far > 0.01 and near <= far / 5, (near, far)
