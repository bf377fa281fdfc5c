"""The references the fused kernels are tested against (tests/cuda_ext_reference.py), on CPU:
the dropout-hash mirror, the masked edge-list reference, and the kernels' gradient algebra."""

import torch

from fairseq_plugins.graph_attention.registry import graph_attention
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present, segtree_graph
from tests.cuda_ext_reference import mix32, dropout_keep_mask, reference_with_mask


def test_dropout_mask_mirror_matches_python_integers():
    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) % 2**32
        x ^= x >> 15
        x = (x * 0x846CA68B) % 2**32
        return x ^ (x >> 16)

    values = torch.randint(0, 2**32, (1000,), dtype=torch.int64)
    assert mix32(values).tolist() == [mix(int(x)) for x in values]
    keep = dropout_keep_mask(torch.tensor([-12345, 2**40]), 3, 1000, 0.25)
    assert abs(keep.float().mean().item() - 0.75) < 0.03


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
