"""Checks of one graph-attention backend through the public op, on any device.

Every check calls ``graph_attention(..., backend=name)`` only, so the same code checks the
triton, cuda, flex and cpu kernels (and, in the CPU test suite, the torch backend and
deliberately broken ones):

* ``check_against_float64``: output and the gradients of query, key, value and relative keys
  against the torch backend in float64 on the CPU, from the same rounded inputs;
* ``check_dropout``: without knowing the kernels' random bits, that one generator state gives
  one mask, a new state a new mask, that the backward regenerates the forward's mask (the
  output is linear in the values for a fixed mask, so ``<dO, out> = <dV, V>``; in fp32 also
  finite differences of the query, key and relative-key gradients at a fixed state), and
  that about ``1 - p`` of the probability mass is kept, scaled by ``1 / (1 - p)``.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from fairseq_plugins.graph_attention import graph_attention
from fairseq_plugins.graphs.attention_graph import AttentionGraph
from fairseq_plugins.graphs.binary_partition import node_present

# max |backend - float64 reference| / max(max |reference|, 1) per dtype. fp32 on a GPU goes
# through tf32x3 products in the triton kernels: about fp32's precision, not all of it.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# |<dO, out> - <dV, V>| allowed relative to the norms of both sides' terms
DROPOUT_IDENTITY_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
NAMES = ("output", "d query", "d key", "d value", "d rel_key")


def make_inputs(graph: AttentionGraph, lengths: Sequence[int], dtype: torch.dtype, dim: int,
                heads: int = 2, seed: int = 0) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """(q, k, v, rel_key) as float64 CPU tensors holding values already rounded to ``dtype``,
    and the key padding mask: the tree's absent spans for ``lengths`` when the graph has a
    tree layout, else a random fifth of the nodes absent in each sentence."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(lengths), heads, graph.num_nodes, dim)
    leaves = [torch.randn(shape, generator=gen) for _ in range(3)]
    leaves.append(0.5 * torch.randn(graph.num_edge_types, dim, generator=gen))
    if graph.tree is not None:
        mask = ~node_present(torch.tensor(list(lengths)), graph.tree.num_tokens)
    else:
        mask = torch.rand(len(lengths), graph.num_nodes, generator=gen) < 0.2
    return [t.to(dtype).double() for t in leaves], mask


def run(backend: str, graph: AttentionGraph, leaves, mask, grad_out, device, dtype,
        dropout_p: float = 0.0) -> List[torch.Tensor]:
    """[output, dq, dk, dv, drel] of ``backend`` on ``device`` in ``dtype``."""
    tensors = [t.detach().to(device, dtype).requires_grad_() for t in leaves]
    out = graph_attention(*tensors[:3], graph, tensors[3], mask.to(device), dropout_p,
                          backend=backend)
    grads = torch.autograd.grad(out, tensors, grad_out.to(device, out.dtype))
    return [out.detach()] + list(grads)


def relative_errors(actual, expected) -> Dict[str, float]:
    """max |a - e| / max(max |e|, 1) per output, computed in float64 on the CPU."""
    return {name: (a.double().cpu() - e).abs().max().item() / max(e.abs().max().item(), 1.0)
            for name, a, e in zip(NAMES, actual, expected)}


def errors_against_float64(backend: str, graph: AttentionGraph, lengths: Sequence[int],
                           dtype: torch.dtype, dim: int, device, heads: int = 2, seed: int = 0,
                           reference_device="cpu") -> Tuple[Dict[str, float], List[str]]:
    """Relative errors of output and all gradients against the torch backend in float64 (on
    ``reference_device``), from the same rounded inputs; and the outputs that came back in
    the wrong dtype or shape."""
    leaves, mask = make_inputs(graph, lengths, dtype, dim, heads, seed)
    grad_out = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(seed + 1))
    grad_out = grad_out.to(dtype).double()
    expected = run("torch", graph, leaves, mask, grad_out, reference_device, torch.float64)
    expected = [e.cpu() for e in expected]
    actual = run(backend, graph, leaves, mask, grad_out, device, dtype)
    wrong = [f"{name}: {a.dtype} {tuple(a.shape)}" for name, a, e in zip(NAMES, actual, expected)
             if a.dtype != dtype or a.shape != e.shape]
    return relative_errors(actual, expected), wrong


def check_against_float64(backend: str, graph: AttentionGraph, lengths: Sequence[int],
                          dtype: torch.dtype, dim: int, device, heads: int = 2, seed: int = 0,
                          tolerance: Optional[float] = None) -> Dict[str, float]:
    """Raise AssertionError unless output and all gradients match the float64 torch backend
    within ``tolerance`` (default ``TOLERANCE[dtype]``) and come back in ``dtype``; return the
    relative errors."""
    errors, wrong = errors_against_float64(backend, graph, lengths, dtype, dim, device, heads, seed)
    assert not wrong, f"{backend}: outputs of the wrong dtype or shape: {wrong}"
    limit = tolerance or TOLERANCE[dtype]
    over = {name: f"{error:.3g}" for name, error in errors.items() if not error <= limit}
    assert not over, f"{backend} vs float64 over {limit:g} (relative): {over}"
    return errors


def _seeded(seed: int, device, fn):
    """``fn()`` with every generator of ``device`` (and the CPU's) seeded, restored after."""
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return fn()


def _dot(a, b) -> float:
    return (a.double().cpu() * b.double().cpu()).sum().item()


def check_dropout(backend: str, graph: AttentionGraph, lengths: Sequence[int], dtype: torch.dtype,
                  dim: int, device, dropout_p: float = 0.3, heads: int = 2, seed: int = 0) -> None:
    """Raise AssertionError unless ``backend``'s attention dropout behaves as described in the
    module docstring."""
    leaves, mask = make_inputs(graph, lengths, dtype, dim, heads, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(leaves[0].shape, generator=gen).to(dtype).double()

    def draw(state, tensors=leaves):
        return _seeded(state, device, lambda: run(backend, graph, tensors, mask, grad_out, device,
                                                  dtype, dropout_p))

    first, again, other = draw(1), draw(1), draw(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), (
        f"{backend}: one generator state gave two different dropout results")
    assert not torch.equal(first[0], other[0]), f"{backend}: a new generator state drew the same mask"
    # <dO, out> = <dV, V> in exact arithmetic when both sides use one mask; rounding moves each
    # side by about eps times its norm, a different mask by about sqrt(2p / (1 - p)) times it
    forward_side, backward_side = grad_out * first[0].double().cpu(), first[3].double().cpu() * leaves[2]
    norm = forward_side.norm().item() + backward_side.norm().item()
    difference = forward_side.sum().item() - backward_side.sum().item()
    assert abs(difference) <= DROPOUT_IDENTITY_TOLERANCE[dtype] * norm, (
        f"{backend}: <dO, out> - <dV, V> = {difference:.4g} (norm {norm:.4g}): the backward did "
        "not apply the forward's dropout mask")
    if dtype == torch.float32:
        _check_directional_derivatives(draw, leaves, first, grad_out, seed)
    ones = [leaves[0], leaves[1], torch.ones_like(leaves[2]), leaves[3]]
    kept = draw(3, ones)[0].double().cpu()[..., 0]  # [B, H, N]: each row's kept mass
    present_edges = (~mask[:, graph.indices]).double()  # rows with no present key return zeros
    has_keys = torch.zeros(mask.shape, dtype=torch.float64).index_add_(1, graph.rows(), present_edges) > 0
    mass = kept[has_keys.unsqueeze(1).expand_as(kept)]
    assert abs(mass.mean().item() - 1.0) < 0.1 and mass.std().item() > 0.05, (
        f"{backend}: kept probability mass per row has mean {mass.mean().item():.3f} and std "
        f"{mass.std().item():.3f}; dropout with p = {dropout_p} keeps about 1 on average, varying")


def _check_directional_derivatives(draw, leaves, first, grad_out, seed, step=3e-2) -> None:
    """Central differences of <dO, out> along random directions of q, k and rel_key, each
    evaluated with the same generator state (so the same mask), against the gradients."""
    gen = torch.Generator().manual_seed(seed + 2)
    for index, name in ((0, "d query"), (1, "d key"), (3, "d rel_key")):
        direction = torch.randn(leaves[index].shape, generator=gen, dtype=torch.float64)
        values = []
        for sign in (1, -1):
            moved = list(leaves)
            moved[index] = leaves[index] + sign * step * direction
            values.append(_dot(grad_out, draw(1, moved)[0]))
        numeric = (values[0] - values[1]) / (2 * step)
        analytic = _dot(first[index + 1], direction)
        assert abs(numeric - analytic) <= 2e-2 * max(abs(analytic), 1.0), (
            f"{name} along a random direction: finite differences {numeric:.6g}, gradient "
            f"{analytic:.6g}: the backward's dropout mask differs from the forward's")


def check_rows_without_keys(backend: str, graph: AttentionGraph, dtype: torch.dtype, dim: int,
                            device) -> None:
    """A sentence with every node absent: zero output and zero gradients, all finite."""
    leaves, _ = make_inputs(graph, [graph.tree.num_tokens] * 2 if graph.tree else [1, 1], dtype,
                            dim)
    mask = torch.zeros(2, graph.num_nodes, dtype=torch.bool)
    mask[1] = True
    grad_out = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(1))
    out, dq, dk, dv, _ = run(backend, graph, leaves, mask, grad_out, device, dtype)
    for name, tensor in (("output", out), ("d query", dq), ("d key", dk), ("d value", dv)):
        assert torch.isfinite(tensor).all(), f"{backend}: {name} is not finite"
        assert tensor[1].abs().max() == 0, f"{backend}: {name} of a sentence without keys is not 0"
