"""The fused CUDA kernels against the torch backend (float64), on a GPU; skipped without one.

Covers float32/float16/bfloat16, head dims 32/64/128, random graphs (empty rows, masked keys)
and real BPT/SegTree graphs from 1 to 16384 tokens, forward and all gradients, dropout
(against a reference that regenerates the kernels' keep mask), and bit-exact repeatability
of backward. Run under compute-sanitizer: see docs/cuda_ext.md.
"""

import pytest
import torch

from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present, segtree_graph
from fairseq_plugins.graph_attention import AttentionGraph, cuda_backend, flex_backend, graph_attention  # noqa: F401



def gpu(test):
    """Marks a test as needing a GPU, and skips it without one."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(test))


# max |cuda - float64 reference| allowed, relative to the reference's max magnitude
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
M32 = 0xFFFFFFFF


def random_graph(n, degree, num_types, seed=0):
    """Random CSR with sorted unique keys per row, varying degrees and some empty rows."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = [], []
    for u in range(n):
        d = int(torch.randint(0, 2 * degree + 1, (1,), generator=gen)) if u % 7 else 0
        keys = torch.randperm(n, generator=gen)[: min(d, n)].sort().values
        rows.append(torch.full_like(keys, u))
        cols.append(keys)
    rows, cols = torch.cat(rows), torch.cat(cols)
    counts = torch.bincount(rows, minlength=n)
    return AttentionGraph(num_nodes=n, indptr=torch.cat([counts.new_zeros(1), counts.cumsum(0)]),
                          indices=cols,
                          edge_type=torch.randint(0, num_types, cols.shape, generator=gen),
                          num_edge_types=num_types)


def make_inputs(graph, batch, heads, dim, dtype, padded_lengths=None, seed=0):
    torch.manual_seed(seed)
    shape = (batch, heads, graph.num_nodes, dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    rel = 0.5 * torch.randn(graph.num_edge_types, dim, device="cuda", dtype=dtype)
    if padded_lengths is not None:  # real tree padding: spans over padding are absent
        kpm = ~node_present(torch.tensor(padded_lengths), graph.tree.num_tokens).cuda()
    else:
        kpm = torch.rand(batch, graph.num_nodes, device="cuda") < 0.2
    return q, k, v, rel, kpm


def run(backend, q, k, v, rel, kpm, graph, dtype=None, grad_out=None):
    """Output and gradients of (q, k, v, rel) for one backend, optionally in another dtype."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v, rel)]
    out = graph_attention(*leaves[:3], graph, leaves[3], kpm, backend=backend)
    out.backward(grad_out.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def assert_close(actual, expected, dtype, what, tolerance=None):
    error = (actual.double() - expected).abs().max().item()
    scale = max(expected.abs().max().item(), 1.0)
    assert error <= (tolerance or TOLERANCE[dtype]) * scale, f"{what}: max error {error:.3g} (scale {scale:.3g})"


def check_against_torch(graph, batch, heads, dim, dtype, padded_lengths=None):
    q, k, v, rel, kpm = make_inputs(graph, batch, heads, dim, dtype, padded_lengths)
    grad_out = torch.randn_like(q)
    expected = run("torch", q, k, v, rel, kpm, graph, torch.float64, grad_out)
    actual = run("cuda", q, k, v, rel, kpm, graph, None, grad_out)
    for name, a, e in zip(("out", "dq", "dk", "dv", "drel"), actual, expected):
        assert a.dtype == dtype
        assert_close(a, e, dtype, name)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 64, 128])
def test_random_graphs_all_dtypes_and_head_dims(dtype, dim):
    check_against_torch(random_graph(300, 12, 9), batch=2, heads=3, dim=dim, dtype=dtype)


@gpu
@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 100, 513, 2048])
@pytest.mark.parametrize("builder", ["bpt1", "bpt4", "bpt4_causal", "segtree"])
def test_tree_graphs(builder, n):
    graph = {"bpt1": lambda: bpt_graph(n, 1), "bpt4": lambda: bpt_graph(n, 4),
             "bpt4_causal": lambda: bpt_graph(n, 4, causal=True),
             "segtree": lambda: segtree_graph(n)}[builder]()
    lengths = [n, max(1, n // 3)]
    check_against_torch(graph, batch=2, heads=2, dim=64, dtype=torch.float32,
                        padded_lengths=lengths)


@gpu
@pytest.mark.parametrize("n,k", [(8192, 4), (16384, 4), (16384, 1)])
def test_long_tree_graphs_half_precision(n, k):
    check_against_torch(bpt_graph(n, k), batch=1, heads=2, dim=64, dtype=torch.float16,
                        padded_lengths=[n - 5])


@gpu
def test_rows_without_present_keys_give_zeros():
    graph = random_graph(50, 4, 3)
    q, k, v, rel, _ = make_inputs(graph, 2, 2, 32, torch.float32)
    kpm = torch.ones(2, 50, dtype=torch.bool, device="cuda")
    kpm[0, :10] = False
    out, dq, dk, dv, drel = run("cuda", q, k, v, rel, kpm, graph, None, torch.randn_like(q))
    assert torch.isfinite(out).all() and out[1].abs().max() == 0 and dq[1].abs().max() == 0
    assert dk[:, :, 10:].abs().max() == 0 and dv[:, :, 10:].abs().max() == 0


@gpu
def test_backward_is_bit_reproducible():
    graph = bpt_graph(1000, 4)
    q, k, v, rel, kpm = make_inputs(graph, 2, 4, 64, torch.float16, padded_lengths=[1000, 700])
    grad_out = torch.randn_like(q)
    first = run("cuda", q, k, v, rel, kpm, graph, None, grad_out)
    for _ in range(3):
        again = run("cuda", q, k, v, rel, kpm, graph, None, grad_out)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@gpu
def test_flex_backend_forward_and_gradients():
    graph = bpt_graph(700, 4)
    q, k, v, rel, kpm = make_inputs(graph, 2, 2, 64, torch.float32, padded_lengths=[700, 300])
    grad_out = torch.randn_like(q)
    expected = run("torch", q, k, v, rel, kpm, graph, torch.float64, grad_out)
    actual = run("flex", q, k, v, rel, kpm, graph, None, grad_out)
    for name, a, e in zip(("out", "dq", "dk", "dv", "drel"), actual, expected):
        assert_close(a, e, torch.float32, f"flex {name}", tolerance=1e-4)


# ----------------------------------------------------------------------------- dropout

def _mul32(x, c):
    """(x * c) mod 2^32 for uint32 values held in int64, without int64 overflow."""
    return (((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c) & M32


def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7feb352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep_mask(rng_state, batch_heads, num_edges, p):
    """Mirror of dropout_bits in the kernels: bool [batch_heads, num_edges]."""
    seed, offset = (int(x) % 2**64 for x in rng_state.tolist())
    h = _mix32(_mix32((seed >> 32) ^ 0x9E3779B9) ^ (seed & M32))
    counter = offset + torch.arange(batch_heads * num_edges, dtype=torch.int64)
    h = _mix32(h ^ ((counter >> 32) & M32))
    h = _mix32(h ^ (counter & M32))
    return (h >= int(p * 2**32)).view(batch_heads, num_edges)


def test_dropout_mask_mirror_matches_python_integers():
    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) % 2**32
        x ^= x >> 15
        x = (x * 0x846CA68B) % 2**32
        return x ^ (x >> 16)

    values = torch.randint(0, 2**32, (1000,), dtype=torch.int64)
    assert _mix32(values).tolist() == [mix(int(x)) for x in values]
    keep = dropout_keep_mask(torch.tensor([-12345, 2**40]), 3, 1000, 0.25)
    assert abs(keep.float().mean().item() - 0.75) < 0.03


def reference_with_mask(q, k, v, rel, kpm, graph, keep, p, scale):
    """Edge-list attention (differentiable) with an explicit dropout keep mask."""
    rows, cols = graph.rows().to(q.device), graph.indices.to(q.device)
    types = graph.edge_type.to(q.device)
    scores = (q[:, :, rows] * (k[:, :, cols] + rel[types])).sum(-1) * scale
    scores = scores.masked_fill(kpm[:, cols].unsqueeze(1), float("-inf"))
    bsz, heads, num_nodes, dim = q.shape
    index = rows.expand(bsz, heads, -1)
    row_max = scores.new_full((bsz, heads, num_nodes), float("-inf"))
    row_max = row_max.scatter_reduce(2, index, scores.detach(), "amax").nan_to_num(0, 0, 0)
    exp = torch.exp(scores - row_max[:, :, rows])
    denom = exp.new_zeros(bsz, heads, num_nodes).index_add(2, rows, exp)
    probs = exp / denom.clamp_min(1e-300)[:, :, rows] * keep.view(bsz, heads, -1) / (1 - p)
    return q.new_zeros(q.shape).index_add(2, rows, probs.unsqueeze(-1) * v[:, :, cols])


def test_reference_without_dropout_matches_torch_backend():
    graph = bpt_graph(45, 2)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, graph.num_nodes, 8, dtype=torch.float64) for _ in range(3))
    rel = torch.randn(graph.num_edge_types, 8, dtype=torch.float64)
    kpm = ~node_present(torch.tensor([45, 9]), 45)
    keep = torch.ones(4, graph.num_edges, dtype=torch.bool)
    torch.testing.assert_close(reference_with_mask(q, k, v, rel, kpm, graph, keep, 0.0, 0.5),
                               graph_attention(q, k, v, graph, rel, kpm, scale=0.5))


def test_kernel_backward_formulas_match_autograd():
    """The kernels' gradient algebra, written with torch ops on CPU: dS = P (dP * keep - Delta)
    with Delta = dO . O, dK/dV summed per key, drel = scale * G^T q with G the per-row, per-type
    sums of dS. Checked against autograd of the reference with the same dropout mask."""
    graph, p, scale = segtree_graph(37), 0.25, 0.3
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, graph.num_nodes, 8, dtype=torch.float64) for _ in range(3))
    rel = torch.randn(graph.num_edge_types, 8, dtype=torch.float64)
    kpm = ~node_present(torch.tensor([37, 20]), 37)
    keep = dropout_keep_mask(torch.tensor([7, 11]), 6, graph.num_edges, p)
    grad_out = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, rel)]
    out = reference_with_mask(*leaves, kpm, graph, keep, p, scale)
    out.backward(grad_out)

    rows, cols, types = graph.rows(), graph.indices, graph.edge_type
    k_eff = k[:, :, cols] + rel[types]
    scores = (scale * q[:, :, rows] * k_eff).sum(-1)
    scores = scores.masked_fill(kpm[:, cols].unsqueeze(1), float("-inf"))
    lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype).scatter_reduce(
        2, rows.expand(2, 3, -1), scores, "amax")
    lse = lse + torch.log(torch.zeros_like(lse).index_add(
        2, rows, torch.exp(scores - lse[:, :, rows]).nan_to_num(0)))
    probs = torch.exp(scores - lse[:, :, rows]).nan_to_num(0)  # rows with lse = -inf: 0
    keep_factor = keep.view(2, 3, -1).to(q.dtype) / (1 - p)
    delta = (grad_out * out.detach()).sum(-1)
    dscore = probs * ((grad_out[:, :, rows] * v[:, :, cols]).sum(-1) * keep_factor
                      - delta[:, :, rows])
    dq = scale * torch.zeros_like(q).index_add(2, rows, dscore.unsqueeze(-1) * k_eff)
    dk = torch.zeros_like(k).index_add(2, cols, dscore.unsqueeze(-1) * scale * q[:, :, rows])
    dv = torch.zeros_like(v).index_add(
        2, cols, (probs * keep_factor).unsqueeze(-1) * grad_out[:, :, rows])
    type_sums = torch.zeros(2, 3, graph.num_nodes, graph.num_edge_types, dtype=q.dtype)
    type_sums = type_sums.index_put((torch.arange(2)[:, None, None], torch.arange(3)[None, :, None],
                                     rows, types), dscore, accumulate=True)
    drel = scale * type_sums.reshape(-1, graph.num_edge_types).t() @ q.reshape(-1, 8)
    for name, mine, leaf in zip(("dq", "dk", "dv", "drel"), (dq, dk, dv, drel), leaves):
        torch.testing.assert_close(mine, leaf.grad, msg=name)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_matches_regenerated_mask(dtype):
    graph, p = bpt_graph(300, 2), 0.3
    q, k, v, rel, kpm = make_inputs(graph, 2, 2, 64, dtype, padded_lengths=[300, 200])
    grad_out = torch.randn_like(q)
    ext = cuda_backend.load_extension()
    csr = cuda_backend._graph_tensors(graph, q.device)
    scale = 64 ** -0.5
    out, lse, rng = ext.forward(q, k, v, rel, *csr[:3], kpm, scale, p)
    grads = ext.backward(grad_out, q, k, v, rel, out, lse, rng, *csr, kpm, scale, p, True)

    keep = dropout_keep_mask(rng, 4, graph.num_edges, p).cuda()
    leaves = [t.double().requires_grad_() for t in (q, k, v, rel)]
    expected = reference_with_mask(*leaves[:3], leaves[3], kpm, graph, keep, p, scale)
    expected.backward(grad_out.double())
    assert_close(out, expected.detach(), dtype, "out")
    for name, a, leaf in zip(("dq", "dk", "dv", "drel"), grads, leaves):
        assert_close(a, leaf.grad, dtype, name)

    # a second call draws a fresh mask from torch's generator
    assert not torch.equal(ext.forward(q, k, v, rel, *csr[:3], kpm, scale, p)[0], out)


# ------------------------------------------------------------------- selection and errors

@gpu
def test_auto_backend_picks_kernels_and_falls_back_for_other_head_dims(monkeypatch):
    graph = bpt_graph(64, 2)
    calls = []
    original = cuda_backend.GraphAttentionFunction.apply
    monkeypatch.setattr(cuda_backend.GraphAttentionFunction, "apply",
                        lambda *a: calls.append(1) or original(*a))
    for dim, used in ((64, 1), (48, 1)):
        q = torch.randn(1, 2, graph.num_nodes, dim, device="cuda")
        graph_attention(q, q, q, graph)
        assert len(calls) == used


@gpu
def test_bad_inputs_raise_clear_errors():
    graph = bpt_graph(40, 1)
    q = torch.randn(1, 2, graph.num_nodes, 64, device="cuda")
    with pytest.raises(ValueError, match="dropout_p"):
        cuda_backend.cuda_graph_attention(q, q, q, graph, dropout_p=1.0)
    with pytest.raises(RuntimeError, match="head dim"):
        cuda_backend.cuda_graph_attention(q[..., :48], q[..., :48], q[..., :48], graph)
    with pytest.raises(RuntimeError, match="same shape|dtype"):
        cuda_backend.cuda_graph_attention(q, q.half(), q, graph)
