"""What the fused kernels are checked against under the CPU host emulation: the mirror of
the kernels' dropout hash, an edge-list reference that takes an explicit dropout mask, and
the comparison of outputs and every gradient with float64."""

import torch

from fairseq_plugins.graph_attention import cuda_backend
from fairseq_plugins.graph_attention.registry import dropout_seed, graph_attention

# max |kernel - float64 reference| allowed, relative to the reference's max magnitude
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
M32 = 0xFFFFFFFF
GRADIENTS = ("out", "dq", "dk", "dv", "drel")


def run(attention, leaves, grad_out, dtype=None):
    """Output and gradients of ``attention(q, k, v, rel)``, optionally in another dtype."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in leaves]
    out = attention(*leaves)
    out.backward(grad_out.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def assert_close(actual, expected, dtype, what, tolerance=None):
    error = (actual.double() - expected).abs().max().item()
    scale = max(expected.abs().max().item(), 1.0)
    assert error <= (tolerance or TOLERANCE[dtype]) * scale, (
        f"{what}: max error {error:.3g} (scale {scale:.3g})")


def check_against_torch(attention, graph, leaves, key_padding_mask, dtype, tolerance=None):
    """``attention`` (a fused build) in ``dtype`` against the torch backend in float64."""
    grad_out = torch.randn_like(leaves[0])
    expected = run(lambda q, k, v, r: graph_attention(q, k, v, graph, r, key_padding_mask,
                                                      backend="torch"),
                   leaves, grad_out, torch.float64)
    actual = run(attention, leaves, grad_out, dtype)
    for name, a, e in zip(GRADIENTS, actual, expected):
        assert a.dtype == dtype, name
        assert_close(a, e, dtype, name, tolerance)


# ------------------------------------------------------------------------------ dropout

def mul32(x, c):
    """(x * c) mod 2^32 for uint32 values held in int64, without int64 overflow."""
    return (((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c) & M32


def mix32(x):
    x = x ^ (x >> 16)
    x = mul32(x, 0x7feb352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep_mask(rng_state, batch_heads, num_edges, p):
    """Mirror of dropout_bits in the kernels: bool [batch_heads, num_edges], kernel order."""
    seed, offset = (int(x) % 2**64 for x in rng_state.tolist())
    h = mix32(mix32((seed >> 32) ^ 0x9E3779B9) ^ (seed & M32))
    counter = offset + torch.arange(batch_heads * num_edges, dtype=torch.int64)
    h = mix32(h ^ ((counter >> 32) & M32))
    h = mix32(h ^ (counter & M32))
    return (h >= int(p * 2**32)).view(batch_heads, num_edges)


def graph_order_keep_mask(rng_state, plan: "cuda_backend.KernelPlan", batch_heads, p):
    """The kernels' keep mask with edges in the graph's order."""
    keep = dropout_keep_mask(rng_state, batch_heads, plan.edge_order.numel(), p)
    in_graph_order = torch.empty_like(keep)
    in_graph_order[:, plan.edge_order] = keep
    return in_graph_order


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


def check_dropout(graph, q, k, v, rel, kpm, p, split_edges=cuda_backend.SPLIT_EDGES, seed=0):
    """The kernels' dropout through the backend's ops (the CUDA build, or the host emulation
    registered as their CPU kernel): forward and gradients against the reference with the
    mask that the (seed, offset) tensor drawn under ``torch.manual_seed(seed)`` gives, so the
    backward regenerates the forward's mask; the same seed gives the same results bit for bit,
    the next draw another mask."""
    grad_out = torch.randn_like(q)
    scale = q.size(-1) ** -0.5

    def attention(*leaves):
        return cuda_backend.fused_graph_attention(*leaves[:3], graph, leaves[3], kpm, p, scale,
                                                  dropout_seed(q.device, p), split_edges)
    torch.manual_seed(seed)
    actual = run(attention, [q, k, v, rel], grad_out)
    torch.manual_seed(seed)
    rng = dropout_seed(q.device, p)
    plan = cuda_backend.plan_on(graph, q.device, split_edges)
    keep = graph_order_keep_mask(rng.cpu(), plan, q.size(0) * q.size(1), p).to(q.device)
    leaves = [t.double().requires_grad_() for t in (q, k, v, rel)]
    expected = reference_with_mask(*leaves, kpm, graph, keep, p, scale)
    expected.backward(grad_out.double())
    for name, a, e in zip(GRADIENTS, actual, [expected.detach()] + [t.grad for t in leaves]):
        assert_close(a, e, q.dtype, name)
    torch.manual_seed(seed)
    again = run(attention, [q, k, v, rel], grad_out)
    assert all(torch.equal(a, b) for a, b in zip(actual, again)), "the same seed gave another result"
    following = run(attention, [q, k, v, rel], grad_out)
    assert not torch.equal(following[0], actual[0]), "the next call drew the same mask"
