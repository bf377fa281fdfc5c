"""``backend="auto"``: on a CUDA tensor a fast backend is used only after it passed its
self-check there; one that fails is named in one warning and never picked. CPU tensors stand
in for CUDA ones through ``registry.wants_fast_backend``."""

import warnings

import pytest
import torch

from fairseq_plugins.graph_attention import registry
from fairseq_plugins.graph_attention.registry import graph_attention
from fairseq_plugins.graphs.binary_partition import bpt_graph

TORCH_FN = registry._BACKENDS["torch"][0]


class FakeBackend:
    """A backend that counts its calls; ``broken`` ones return slightly wrong outputs."""

    def __init__(self, broken=False, available=True):
        self.broken, self.available, self.calls = broken, available, 0

    def __call__(self, query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale):
        self.calls += 1
        out = TORCH_FN(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale)
        return out * 1.01 if self.broken else out

    def is_available(self, query):
        return self.available


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors count as CUDA ones; a fresh self-check cache; no real fast backends."""
    monkeypatch.setattr(registry, "wants_fast_backend", lambda query: True)
    monkeypatch.setattr(registry, "_SELF_CHECKS", {})
    registry._load_optional_backends()
    for name in registry.AUTO_PREFERENCE:
        monkeypatch.delitem(registry._BACKENDS, name, raising=False)

    def install(name, backend):
        monkeypatch.setitem(registry._BACKENDS, name, (backend, backend.is_available))
        return backend
    return install


def _inputs(dim=16):
    graph = bpt_graph(30, 2)
    q, k, v = (torch.randn(2, 2, graph.num_nodes, dim) for _ in range(3))
    return graph, q, k, v


def test_a_backend_failing_its_self_check_is_never_picked(fake_gpu):
    broken = fake_gpu("cuda", FakeBackend(broken=True))
    graph, q, k, v = _inputs()
    with pytest.warns(RuntimeWarning, match=r"'cuda' failed its self-check.*differs from"):
        out = graph_attention(q, k, v, graph)
    torch.testing.assert_close(out, graph_attention(q, k, v, graph, backend="torch"))
    calls = broken.calls  # the self-check's call only
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: no second warning
        for _ in range(3):
            graph_attention(q, k, v, graph)
    assert broken.calls == calls == 1 and registry.auto_backend(q) == "torch"


def test_preference_is_triton_then_cuda_and_a_missing_backend_is_skipped(fake_gpu):
    graph, q, k, v = _inputs()
    cuda = fake_gpu("cuda", FakeBackend())
    assert registry.auto_backend(q) == "cuda"  # no triton registered: skipped
    triton = fake_gpu("triton", FakeBackend())
    assert registry.auto_backend(q) == "triton"
    graph_attention(q, k, v, graph)
    assert triton.calls == 2 and cuda.calls == 1  # self-checks, then the real call


def test_a_failing_first_choice_falls_through_to_the_next(fake_gpu):
    fake_gpu("triton", FakeBackend(broken=True))
    fake_gpu("cuda", FakeBackend())
    with pytest.warns(RuntimeWarning, match="'triton' failed"):
        assert registry.auto_backend(torch.randn(1, 1, 4, 16)) == "cuda"


def test_self_check_is_per_dtype_and_head_dim_and_skips_unavailable(fake_gpu):
    cuda = fake_gpu("cuda", FakeBackend())
    for dim in (16, 16, 32):
        assert registry.auto_backend(torch.randn(1, 1, 4, dim)) == "cuda"
    assert cuda.calls == 2  # one check per head dim
    cuda.available = False
    assert registry.auto_backend(torch.randn(1, 1, 4, 64)) == "torch" and cuda.calls == 2


def test_self_check_runs_under_inference_mode(fake_gpu):
    fake_gpu("cuda", FakeBackend())
    with torch.inference_mode():
        assert registry.auto_backend(torch.randn(1, 1, 4, 16)) == "cuda"


def test_cpu_tensors_never_look_for_a_gpu_backend(monkeypatch):
    monkeypatch.setattr(registry, "_SELF_CHECKS", {})
    backend = FakeBackend()
    monkeypatch.setitem(registry._BACKENDS, "cuda", (backend, backend.is_available))
    assert registry.auto_backend(torch.randn(1, 1, 4, 16)) != "cuda" and backend.calls == 0


def test_self_check_catches_a_wrong_gradient():
    def wrong_value_gradient(query, key, value, *rest):
        out = TORCH_FN(query, key, value.detach(), *rest)  # no gradient for value
        return out + 0 * value

    with pytest.raises(RuntimeError, match="d value differs"):
        registry.self_check(wrong_value_gradient, "cpu", torch.float32, 16)
    registry.self_check(TORCH_FN, "cpu", torch.float32, 16)  # the reference passes
