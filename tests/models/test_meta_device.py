"""Every model and every torch attention path with all tensors on the ``meta`` device: a CPU
tensor mixed in raises there as it would on CUDA, so this checks the GPU code paths' device
handling without a GPU. Host reads are recorded on a CPU run and replayed
(tests/meta_device.py); the attention paths must not read anything back from the device."""

import pytest
import torch

from fairseq_plugins.check_gpu.cases import random_graph
from fairseq_plugins.graph_attention import registry
from fairseq_plugins.graph_attention.torch_backend import csr_attention, dense_graph_attention
from fairseq_plugins.graph_attention.torch_tree import tree_block_attention
from fairseq_plugins.graphs.binary_partition import bpt_graph, node_present
from tests.meta_device import HostReads
from tests.models.test_checkpoint_compat import FIXTURES, _batch

MODELS = ["bpt_transformer", "segtree_transformer", "transformer_slowfast", "ms_transformer",
          "bpt_document"]


def on_cpu_then_meta(step):
    """step(device) on CPU (recording host reads), then on meta (replaying them)."""
    with HostReads() as recording:
        step("cpu")
    with HostReads(recording.recorded) as replay:
        result = step("meta")
    return result, replay


@pytest.mark.parametrize("arch", MODELS)
def test_model_forward_and_backward_on_meta(arch, monkeypatch):
    # on meta, "auto" takes the torch backend: the recording CPU run must take it too (the
    # cpu kernel's self-check would add host reads that the meta run never makes)
    monkeypatch.setattr(registry, "DEFAULT", registry.Dispatcher(cpu_preference=()))
    from fairseq import checkpoint_utils

    folder = FIXTURES / arch
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(folder / "checkpoint.pt")], arg_overrides={"data": str(folder)})
    model = models[0].train()
    batch = _batch(task.source_dictionary)

    def step(device):
        model.zero_grad(set_to_none=True)
        model.to(device)
        torch.manual_seed(0)
        logits, _ = model(*(t.to(device) for t in batch))
        logits.float().logsumexp(-1).mean().backward()
        return logits

    logits, _ = on_cpu_then_meta(step)
    assert logits.is_meta and logits.shape[:2] == batch[2].shape
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    grads = {p.grad.device.type for p in model.parameters() if p.grad is not None}
    assert grads == {"meta"} and len(missing) < len(list(model.parameters())), missing


def _attention_inputs(graph, device, lengths=None):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, graph.num_nodes, 16, generator=gen).to(device).requires_grad_()
               for _ in range(3))
    rel = torch.randn(graph.num_edge_types, 16, generator=gen).to(device).requires_grad_()
    if lengths is None:
        kpm = torch.rand(2, graph.num_nodes, generator=gen) < 0.2
    else:
        kpm = ~node_present(torch.tensor(lengths), graph.tree.num_tokens)
    return (q, k, v, rel), kpm.to(device)


PATHS = {
    "dense": (lambda: bpt_graph(20, 2), [20, 7],
              lambda g, q, k, v, r, m, d: dense_graph_attention(q, k, v, g, r, m, 0.1, 0.25)),
    "tree": (lambda: bpt_graph(150, 4), [150, 61],
             lambda g, q, k, v, r, m, d: tree_block_attention(q, k, v, g, r, m, 0.1, 0.25)),
    "csr": (lambda: random_graph(40, 6, 3), None,
            lambda g, q, k, v, r, m, d: csr_attention(q, k, v, *g.on(d), r, m, 0.1, 0.25)),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_torch_attention_path_on_meta_without_host_reads(path):
    build, lengths, attention = PATHS[path]
    graph = build()

    def step(device):
        (q, k, v, rel), kpm = _attention_inputs(graph, device, lengths)
        out = attention(graph, q, k, v, rel, kpm, device)
        out.sum().backward()
        return out, [t.grad for t in (q, k, v, rel)]

    (out, grads), replay = on_cpu_then_meta(step)
    assert out.is_meta and all(g is not None and g.is_meta for g in grads)
    assert replay.replayed == [], f"host reads of device tensors: {replay.replayed}"


def test_a_cpu_tensor_mixed_in_raises_on_meta():
    def step(device):
        x = torch.randn(4, 8).to(device)
        return x + torch.arange(8.0)  # a CPU tensor: fine on CPU, an error on CUDA and meta

    with pytest.raises(RuntimeError, match="device"):
        on_cpu_then_meta(step)


def test_host_reads_and_value_dependent_shapes_are_replayed():
    def step(device):
        x = torch.tensor([3.0, -1.0, 2.0, -5.0]).to(device).requires_grad_()
        picked = x[x > 0]  # value-dependent shape
        scale = float(x.detach().abs().max())  # a host read
        (picked * scale).sum().backward()
        return picked, x.grad, scale

    (picked, grad, scale), replay = on_cpu_then_meta(step)
    assert picked.is_meta and picked.shape == (2,) and grad.is_meta and scale == 5.0
    assert len(replay.replayed) == 2
