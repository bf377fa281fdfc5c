"""``backend="auto"``: on a CUDA tensor a fast backend is used only after it passed its
self-check there; one that fails is named in one warning and never picked (which of those
that pass is fastest: test_graph_attention_autotune). Each test builds its own
``registry.Dispatcher``, in which CPU tensors stand in for CUDA ones (``timed_devices``)."""

import logging
import warnings

import pytest
import torch

from fairseq_plugins.graph_attention import autotune, registry
from fairseq_plugins.graphs.binary_partition import bpt_graph

TORCH_FN = registry.DEFAULT.get("torch").fn


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
def dispatcher(monkeypatch, tmp_path):
    """A dispatcher in which CPU tensors count as CUDA ones, without the real fast backends;
    the candidates triton and cuda (the timing itself: test_graph_attention_autotune), timed
    equal, once after a warm-up, into tmp_path."""
    monkeypatch.delenv(registry.BACKEND_ENV, raising=False)
    dispatcher = registry.Dispatcher(auto_candidates=("triton", "cuda"), timed_devices=("cpu",),
                                     autotuner=autotune.Autotuner(tmp_path, equal_times, repeats=1))
    for name in ("triton", "cuda", "flex"):
        dispatcher.backends.pop(name, None)
    return dispatcher


def install(dispatcher, name, backend, prepare=None):
    """Register the fake ``backend`` as ``name`` in ``dispatcher``; returns it."""
    dispatcher.register(registry.Backend(name, backend, backend.refuses, *([prepare] if prepare else [])))
    return backend


def _self_check_calls():
    backend = FakeBackend()
    registry.self_check(backend, "cpu", torch.float32, 16)
    return backend.calls


CHECK_CALLS = _self_check_calls()  # backend calls of one passing self-check
GRAPH = bpt_graph(4, 2)  # 4 tokens: as many nodes as the tensors handed to dispatcher.auto below


def _inputs(dim=16):
    graph = bpt_graph(30, 2)
    q, k, v = (torch.randn(2, 2, graph.num_nodes, dim) for _ in range(3))
    return graph, q, k, v


def test_a_backend_failing_its_self_check_is_never_picked(dispatcher):
    broken = install(dispatcher, "cuda", FakeBackend(broken=True))
    graph, q, k, v = _inputs()
    with pytest.warns(RuntimeWarning, match=r"'cuda' failed its self-check.*differs from"):
        out = dispatcher.graph_attention(q, k, v, graph)
    torch.testing.assert_close(out, dispatcher.graph_attention(q, k, v, graph, backend="torch"))
    calls = broken.calls  # the self-check's call only
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: no second warning
        for _ in range(3):
            dispatcher.graph_attention(q, k, v, graph)
    assert broken.calls == calls == 1 and dispatcher.auto(q, graph) == "torch"


def test_a_missing_backend_is_skipped_and_equal_times_keep_the_candidates_order(dispatcher):
    graph, q, k, v = _inputs()
    cuda = install(dispatcher, "cuda", FakeBackend())
    assert dispatcher.auto(q, graph) == "cuda"  # no triton registered: skipped, nothing timed
    triton = install(dispatcher, "triton", FakeBackend())
    assert dispatcher.auto(q, graph) == "triton"
    dispatcher.graph_attention(q, k, v, graph)
    timed = 2  # a warm-up and one timed run
    assert triton.calls == CHECK_CALLS + timed + 1 and cuda.calls == CHECK_CALLS + timed  # then the real call


def test_a_failing_first_choice_falls_through_to_the_next(dispatcher):
    install(dispatcher, "triton", FakeBackend(broken=True))
    install(dispatcher, "cuda", FakeBackend())
    with pytest.warns(RuntimeWarning, match="'triton' failed"):
        assert dispatcher.auto(torch.randn(1, 1, 4, 16), GRAPH) == "cuda"


def test_self_check_is_per_dtype_and_head_dim_and_skips_unavailable(dispatcher):
    cuda = install(dispatcher, "cuda", FakeBackend())
    for dim in (16, 16, 32):
        assert dispatcher.auto(torch.randn(1, 1, 4, dim), GRAPH) == "cuda"
    assert cuda.calls == 2 * CHECK_CALLS  # one check per head dim
    cuda.available = False
    assert dispatcher.auto(torch.randn(1, 1, 4, 64), GRAPH) == "torch" and cuda.calls == 2 * CHECK_CALLS


def test_self_check_runs_under_inference_mode(dispatcher):
    install(dispatcher, "cuda", FakeBackend())
    with torch.inference_mode():
        assert dispatcher.auto(torch.randn(1, 1, 4, 16), GRAPH) == "cuda"


def test_cpu_tensors_never_look_for_a_gpu_backend():
    dispatcher = registry.Dispatcher()
    backend = install(dispatcher, "cuda", FakeBackend())
    assert dispatcher.auto(torch.randn(1, 1, 4, 16), GRAPH) != "cuda" and backend.calls == 0


def test_self_check_catches_a_wrong_gradient():
    def wrong_value_gradient(query, key, value, *rest):
        out = TORCH_FN(query, key, value.detach(), *rest)  # no gradient for value
        return out + 0 * value

    with pytest.raises(RuntimeError, match="d value differs"):
        registry.self_check(wrong_value_gradient, "cpu", torch.float32, 16)
    registry.self_check(TORCH_FN, "cpu", torch.float32, 16)  # the reference passes


def test_a_backend_that_refuses_the_inputs_is_skipped_by_auto_and_named_when_forced(dispatcher):
    refusing = install(dispatcher, "cuda", FakeBackend(available=False))
    graph, q, k, v = _inputs()
    assert dispatcher.auto(q, graph) == "torch" and refusing.calls == 0
    with pytest.raises(RuntimeError, match="'cuda' cannot run these inputs: switched off"):
        dispatcher.graph_attention(q, k, v, graph, backend="cuda")


def test_prepare_runs_before_use_and_its_failure_fails_the_self_check(dispatcher):
    def cannot_build(query, graph):
        raise RuntimeError("no compiler")
    backend = install(dispatcher, "cuda", FakeBackend(), cannot_build)
    graph, q, k, v = _inputs()
    with pytest.warns(RuntimeWarning, match="'cuda' failed its self-check.*no compiler"):
        assert dispatcher.auto(q, graph) == "torch"
    with pytest.raises(RuntimeError, match="no compiler"):
        dispatcher.graph_attention(q, k, v, graph, backend="cuda")
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


def test_a_missing_optional_dependency_is_recorded_and_a_broken_backend_warned():
    modules = {"torch": "fairseq_plugins.graph_attention.torch_backend",
               "needs_dependency": "some_missing_gpu_library_for_the_test",
               "broken": "fairseq_plugins.graph_attention.no_such_backend_module"}
    dispatcher = registry.Dispatcher(modules)
    with pytest.warns(RuntimeWarning, match="'broken' failed to import") as record:
        errors = dispatcher.import_errors()
    assert len(record) == 1  # a missing third-party module is expected: no warning
    assert set(errors) == {"needs_dependency", "broken"}
    assert "some_missing_gpu_library_for_the_test" in errors["needs_dependency"]
    graph, q, k, v = _inputs()
    with pytest.raises(ValueError, match="'needs_dependency' could not be imported: ModuleNotFoundError"):
        dispatcher.graph_attention(q, k, v, graph, backend="needs_dependency")
    with pytest.raises(ValueError, match="'nonsense' is not registered"):
        dispatcher.graph_attention(q, k, v, graph, backend="nonsense")


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


def test_refuses_names_why_a_backend_cannot_run(dispatcher):
    install(dispatcher, "cuda", FakeBackend(available=False))
    q = torch.randn(1, 1, GRAPH.num_nodes, 16)
    assert dispatcher.refuses("torch", q, GRAPH) is None
    assert dispatcher.refuses("cuda", q, GRAPH) == "switched off"
    assert "'triton' is not registered" in dispatcher.refuses("triton", q, GRAPH)
    missing = registry.Dispatcher({"torch": registry.BACKEND_MODULES["torch"], "gone": "no_such_module_for_the_test"})
    assert "'gone' could not be imported: ModuleNotFoundError" in missing.refuses("gone", q, GRAPH)


def test_auto_on_the_torch_backend_logs_once_per_device_and_dtype_why(dispatcher, caplog):
    install(dispatcher, "cuda", FakeBackend(available=False))
    install(dispatcher, "triton", FakeBackend(broken=True))
    with caplog.at_level(logging.INFO, logger=registry.__name__), \
            pytest.warns(RuntimeWarning, match="'triton' failed its self-check"):
        for _ in range(2):
            assert dispatcher.auto(torch.randn(1, 1, 4, 16), GRAPH) == "torch"
            assert dispatcher.auto(torch.randn(1, 1, 4, 32), GRAPH) == "torch"  # same device and dtype
        assert dispatcher.auto(torch.randn(1, 1, 4, 16, dtype=torch.float64), GRAPH) == "torch"
    messages = [r.getMessage() for r in caplog.records if "auto uses the torch backend" in r.getMessage()]
    assert len(messages) == 2 and "on cpu / float64" in messages[1]
    assert messages[0].startswith("graph attention auto uses the torch backend on cpu / float32 (")
    assert "triton: self-check: RuntimeError: output differs" in messages[0] and "cuda: switched off" in messages[0]


def test_auto_on_cpu_logs_why_the_cpu_kernel_is_not_used(caplog):
    dispatcher = registry.Dispatcher()
    install(dispatcher, "cpu", FakeBackend(available=False))
    with caplog.at_level(logging.INFO, logger=registry.__name__):
        assert dispatcher.auto(torch.randn(1, 1, 4, 16), GRAPH) == "torch"
        assert registry.Dispatcher(cpu_preference=()).auto(torch.randn(1, 1, 4, 16), GRAPH) == "torch"
    assert [r.getMessage() for r in caplog.records] == [
        "graph attention auto uses the torch backend on cpu / float32 (cpu: switched off)",
        "graph attention auto uses the torch backend on cpu / float32 (no fast backend runs on cpu)"]


def test_the_command_lines_offer_the_registrys_backends():
    from fairseq_plugins.check_gpu import command, op_benchmark
    from fairseq_plugins.models.bpt_transformer import GRAPH_ATTENTION_BACKENDS

    assert GRAPH_ATTENTION_BACKENDS == ("auto", *registry.BACKEND_NAMES)
    assert set(registry.BACKEND_NAMES) == set(registry.DEFAULT.backends) | set(registry.DEFAULT.import_errors())
    assert op_benchmark.GRAPH_BACKENDS == registry.AUTO_CANDIDATES
    assert set(command.TEST_GROUPS) == {*registry.AUTO_CANDIDATES, "auto"}
    assert set(registry.AUTO_CANDIDATES) | set(registry.OWN_GPU_KERNELS) <= set(registry.BACKEND_NAMES)


class SeedRecorder(FakeBackend):
    """A seeded backend: records the seed it gets (the torch backend computes)."""

    def __call__(self, *inputs, seed):
        self.seeds = getattr(self, "seeds", []) + [seed]
        return super().__call__(*inputs)


def test_the_op_draws_the_seed_and_answers_an_edgeless_graph_once_for_every_backend(dispatcher):
    recorder = SeedRecorder()
    dispatcher.register(registry.Backend("seeded", recorder, recorder.refuses, seeded=True))
    graph, q, k, v = _inputs()
    dispatcher.graph_attention(q, k, v, graph, backend="seeded")
    torch.manual_seed(4)
    dispatcher.graph_attention(q, k, v, graph, dropout_p=0.1, backend="seeded")
    torch.manual_seed(4)
    expected = registry.dropout_seed("cpu", 0.1)
    assert recorder.seeds[0] is None and torch.equal(recorder.seeds[1], expected)
    assert expected.shape == (2,) and expected.dtype == torch.int64
    edgeless = bpt_graph(4, 2)
    edgeless = type(edgeless)(edgeless.num_nodes, torch.zeros(edgeless.num_nodes + 1, dtype=torch.long),
                              torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 1)
    q = torch.randn(2, 2, edgeless.num_nodes, 16)
    calls = recorder.calls
    for backend in ("seeded", "torch"):
        assert torch.equal(dispatcher.graph_attention(q, q, q, edgeless, backend=backend), torch.zeros_like(q))
    assert recorder.calls == calls
