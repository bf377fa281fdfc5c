"""``backend="auto"``: on a CUDA tensor a fast backend is used only after it passed its
self-check there; one that fails is named in one warning and never picked (which of those
that pass is fastest: test_graph_attention_autotune). CPU tensors stand
in for CUDA ones through ``registry.wants_fast_backend``."""

import warnings

import pytest
import torch

from fairseq_plugins.graph_attention import autotune, registry
from fairseq_plugins.graph_attention.registry import graph_attention
from fairseq_plugins.graphs.binary_partition import bpt_graph

TORCH_FN = registry._BACKENDS["torch"].fn


class FakeBackend:
    """A backend that counts its calls; ``broken`` ones return slightly wrong outputs."""

    def __init__(self, broken=False, available=True):
        self.broken, self.available, self.calls = broken, available, 0

    def __call__(self, query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale):
        self.calls += 1
        out = TORCH_FN(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale)
        return out * 1.01 if self.broken else out

    def refuses(self, query, graph, dropout_p):
        return None if self.available else "switched off"


def equal_times(run, device):
    """A timer under which every candidate is as fast: the candidates' order decides."""
    run()
    return 1.0


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """CPU tensors count as CUDA ones; a fresh self-check cache; no real fast backends; the
    candidates triton and cuda (the timing itself: test_graph_attention_autotune), timed
    equal, once after a warm-up, into tmp_path."""
    monkeypatch.setattr(registry, "wants_fast_backend", lambda query: True)
    monkeypatch.setattr(registry, "_SELF_CHECKS", {})
    monkeypatch.setattr(registry, "AUTO_CANDIDATES", ("triton", "cuda"))
    monkeypatch.setattr(registry, "AUTOTUNER", autotune.Autotuner(tmp_path, equal_times, repeats=1))
    monkeypatch.delenv(registry.BACKEND_ENV, raising=False)
    registry._load_optional_backends()
    for name in ("triton", "cuda", "flex"):
        monkeypatch.delitem(registry._BACKENDS, name, raising=False)

    def install(name, backend):
        monkeypatch.setitem(registry._BACKENDS, name, registry.Backend(name, backend, backend.refuses))
        return backend
    return install


def _self_check_calls():
    backend = FakeBackend()
    registry.self_check(backend, "cpu", torch.float32, 16)
    return backend.calls


CHECK_CALLS = _self_check_calls()  # backend calls of one passing self-check
GRAPH = bpt_graph(4, 2)  # 4 tokens: as many nodes as the tensors handed to auto_backend below


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
    assert broken.calls == calls == 1 and registry.auto_backend(q, graph) == "torch"


def test_a_missing_backend_is_skipped_and_equal_times_keep_the_candidates_order(fake_gpu):
    graph, q, k, v = _inputs()
    cuda = fake_gpu("cuda", FakeBackend())
    assert registry.auto_backend(q, graph) == "cuda"  # no triton registered: skipped, nothing timed
    triton = fake_gpu("triton", FakeBackend())
    assert registry.auto_backend(q, graph) == "triton"
    graph_attention(q, k, v, graph)
    timed = 2  # a warm-up and one timed run
    assert triton.calls == CHECK_CALLS + timed + 1 and cuda.calls == CHECK_CALLS + timed  # then the real call


def test_a_failing_first_choice_falls_through_to_the_next(fake_gpu):
    fake_gpu("triton", FakeBackend(broken=True))
    fake_gpu("cuda", FakeBackend())
    with pytest.warns(RuntimeWarning, match="'triton' failed"):
        assert registry.auto_backend(torch.randn(1, 1, 4, 16), GRAPH) == "cuda"


def test_self_check_is_per_dtype_and_head_dim_and_skips_unavailable(fake_gpu):
    cuda = fake_gpu("cuda", FakeBackend())
    for dim in (16, 16, 32):
        assert registry.auto_backend(torch.randn(1, 1, 4, dim), GRAPH) == "cuda"
    assert cuda.calls == 2 * CHECK_CALLS  # one check per head dim
    cuda.available = False
    assert registry.auto_backend(torch.randn(1, 1, 4, 64), GRAPH) == "torch" and cuda.calls == 2 * CHECK_CALLS


def test_self_check_runs_under_inference_mode(fake_gpu):
    fake_gpu("cuda", FakeBackend())
    with torch.inference_mode():
        assert registry.auto_backend(torch.randn(1, 1, 4, 16), GRAPH) == "cuda"


def test_cpu_tensors_never_look_for_a_gpu_backend(monkeypatch):
    monkeypatch.setattr(registry, "_SELF_CHECKS", {})
    backend = FakeBackend()
    monkeypatch.setitem(registry._BACKENDS, "cuda", registry.Backend("cuda", backend, backend.refuses))
    assert registry.auto_backend(torch.randn(1, 1, 4, 16), GRAPH) != "cuda" and backend.calls == 0


def test_self_check_catches_a_wrong_gradient():
    def wrong_value_gradient(query, key, value, *rest):
        out = TORCH_FN(query, key, value.detach(), *rest)  # no gradient for value
        return out + 0 * value

    with pytest.raises(RuntimeError, match="d value differs"):
        registry.self_check(wrong_value_gradient, "cpu", torch.float32, 16)
    registry.self_check(TORCH_FN, "cpu", torch.float32, 16)  # the reference passes


def test_a_backend_that_refuses_the_inputs_is_skipped_by_auto_and_named_when_forced(fake_gpu):
    refusing = fake_gpu("cuda", FakeBackend(available=False))
    graph, q, k, v = _inputs()
    assert registry.auto_backend(q, graph) == "torch" and refusing.calls == 0
    with pytest.raises(RuntimeError, match="'cuda' cannot run these inputs: switched off"):
        graph_attention(q, k, v, graph, backend="cuda")


def test_prepare_runs_before_use_and_its_failure_fails_the_self_check(fake_gpu, monkeypatch):
    backend = fake_gpu("cuda", FakeBackend())

    def cannot_build(query, graph):
        raise RuntimeError("no compiler")
    monkeypatch.setitem(registry._BACKENDS, "cuda", registry.Backend("cuda", backend, backend.refuses,
                                                                     cannot_build))
    graph, q, k, v = _inputs()
    with pytest.warns(RuntimeWarning, match="'cuda' failed its self-check.*no compiler"):
        assert registry.auto_backend(q, graph) == "torch"
    with pytest.raises(RuntimeError, match="no compiler"):
        graph_attention(q, k, v, graph, backend="cuda")
    assert backend.calls == 0


def test_refusing_never_builds_an_extension(monkeypatch):
    """The compiled backends' ``refuses`` answer from devices, dtypes and shapes only."""
    from fairseq_plugins.graph_attention import cpu_backend, cuda_backend
    from fairseq_plugins.graph_attention.extension_build import Extension

    def no_build(self, verbose):
        raise AssertionError(f"{self.name} built inside a refusal check")
    monkeypatch.setattr(Extension, "_build", no_build)
    monkeypatch.setattr(cpu_backend.EXTENSION, "_module", None)
    monkeypatch.setattr(cuda_backend.EXTENSION, "_module", None)
    graph = bpt_graph(8, 2)
    for dtype in (torch.float32, torch.float16):
        q = torch.zeros(1, 1, graph.num_nodes, 32, dtype=dtype)
        cpu_backend.refuses(q, graph, 0.0)
        cuda_backend.refuses(q, graph, 0.1)


def test_a_missing_optional_dependency_is_recorded_and_a_broken_backend_warned(monkeypatch):
    modules = {"present": "fairseq_plugins.graph_attention.torch_backend",
               "needs_dependency": "some_missing_gpu_library_for_the_test",
               "broken": "fairseq_plugins.graph_attention.no_such_backend_module"}
    monkeypatch.setattr(registry, "OPTIONAL_BACKENDS", modules)
    monkeypatch.setattr(registry, "_OPTIONAL_IMPORT_TRIED", False)
    monkeypatch.setattr(registry, "_IMPORT_ERRORS", {})
    with pytest.warns(RuntimeWarning, match="'broken' failed to import") as record:
        errors = registry.backend_import_errors()
    assert len(record) == 1  # a missing third-party module is expected: no warning
    assert set(errors) == {"needs_dependency", "broken"}
    assert "some_missing_gpu_library_for_the_test" in errors["needs_dependency"]
    graph, q, k, v = _inputs()
    with pytest.raises(ValueError, match="'needs_dependency' could not be imported: ModuleNotFoundError"):
        graph_attention(q, k, v, graph, backend="needs_dependency")
    with pytest.raises(ValueError, match="'nonsense' is not registered"):
        graph_attention(q, k, v, graph, backend="nonsense")


def test_an_extension_that_fails_to_build_is_not_retried(tmp_path):
    from fairseq_plugins.graph_attention.extension_build import Extension

    calls = []

    def requirement():
        calls.append(1)
        return "no toolchain here"
    source = tmp_path / "kernel.cpp"
    source.write_text("")
    extension = Extension("test_ext", "test", "tag", (source,), requirement=requirement)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="no toolchain here"):
            extension.load()
    assert len(calls) == 1


def test_the_self_check_leaves_torchs_random_state_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    registry.self_check(TORCH_FN, "cpu", torch.float32, 16)
    assert torch.equal(torch.rand(3), expected)
