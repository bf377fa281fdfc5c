"""``backend="auto"`` on a GPU times the correct candidates and keeps the fastest.

CPU tensors stand in for CUDA ones (a ``registry.Dispatcher`` that times on CPU), fake backends
are registered in it, and a fake clock stands in for the device: each fake adds
its cost to the clock when called, and the injected timer reads the clock around a run."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from fairseq_plugins.graph_attention import autotune, registry
from fairseq_plugins.graphs.binary_partition import bpt_graph

TORCH_FN = registry.DEFAULT.get("torch").fn
CANDIDATES = ("slow", "raising", "broken", "refusing", "fast", "torch")


class FakeClock:
    def __init__(self):
        self.now, self.timed_runs = 0.0, 0

    def timer(self, run, device):
        self.timed_runs += 1
        start = self.now
        run()
        return self.now - start


class Fake:
    """A backend costing ``ms`` on the fake clock per call (``first_ms`` on its first: a
    compile); ``broken``: slightly wrong outputs; ``refusal``: what ``refuses`` answers;
    ``raise_when_timed``: raises on the timing workload (``TIMING_HEADS`` heads)."""

    def __init__(self, clock, ms, first_ms=None, broken=False, refusal=None, raise_when_timed=False):
        self.clock, self.ms, self.first_ms = clock, ms, first_ms
        self.broken, self.refusal, self.raise_when_timed = broken, refusal, raise_when_timed
        self.calls, self.no_dropout = 0, False

    def __call__(self, query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale):
        assert not (self.no_dropout and dropout_p > 0), "called with the dropout it refuses"
        if self.raise_when_timed and query.size(1) == registry.TIMING_HEADS:
            raise RuntimeError("CUDA out of memory (fake)")
        self.clock.now += (self.first_ms if self.calls == 0 and self.first_ms else self.ms) / 1e3
        self.calls += 1
        out = TORCH_FN(query, key, value, graph, rel_key, key_padding_mask, dropout_p, scale)
        return out * 1.01 if self.broken else out

    def refuses(self, query, graph, dropout_p):
        return "no dropout" if self.no_dropout and dropout_p > 0 else self.refusal


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """A dispatcher (``clock.dispatcher``) in which CPU tensors count as CUDA ones, the fakes
    of ``CANDIDATES`` are registered (the torch backend wrapped so that it costs 3 ms), with
    small timing workloads and a timing cache in tmp_path."""
    monkeypatch.delenv(registry.BACKEND_ENV, raising=False)
    clock = FakeClock()
    clock.dispatcher = registry.Dispatcher(auto_candidates=CANDIDATES, timed_devices=("cpu",),
                                           autotuner=autotune.Autotuner(tmp_path / "cache", clock.timer),
                                           timing_batch_nodes=64)
    fakes = {"slow": Fake(clock, 5.0), "raising": Fake(clock, 0.1, raise_when_timed=True),
             "broken": Fake(clock, 0.1, broken=True), "refusing": Fake(clock, 0.1, refusal="no dropout here"),
             "fast": Fake(clock, 1.0, first_ms=100.0), "torch": Fake(clock, 3.0)}
    for name, fake in fakes.items():
        clock.dispatcher.register(registry.Backend(name, fake, fake.refuses))
    clock.fakes, clock.cache = fakes, tmp_path / "cache"
    return clock


def _inputs(tokens=30, dim=16, dtype=torch.float32):
    graph = bpt_graph(tokens, 2)
    q, k, v = (torch.randn(2, 2, graph.num_nodes, dim, dtype=dtype) for _ in range(3))
    return graph, q, k, v, torch.randn(graph.num_edge_types, dim, dtype=dtype)


def _auto(dispatcher, graph, q, rel=None, dropout_p=0.0):
    return dispatcher.auto(q, graph, dropout_p, None if rel is None else rel.dtype)


def test_auto_keeps_the_fastest_correct_backend_and_logs_the_times_once(gpu, caplog):
    graph, q, k, v, rel = _inputs()
    with pytest.warns(RuntimeWarning, match="'broken' failed its self-check"), \
            caplog.at_level(logging.INFO, logger=autotune.__name__):
        out = gpu.dispatcher.graph_attention(q, k, v, graph, rel)
    assert gpu.fakes["fast"].calls > 0
    torch.testing.assert_close(out, TORCH_FN(q, k, v, graph, rel, None, 0.0, 16 ** -0.5))
    (timing,) = gpu.dispatcher.autotuner._timings.values()
    # the refusing one is never timed, the broken one never trusted; the compile is not timed
    assert set(timing.times_ms) == {"slow", "fast", "torch"} and set(timing.failed) == {"raising", "broken"}
    assert timing.times_ms == pytest.approx({"slow": 5.0, "fast": 1.0, "torch": 3.0})
    assert "CUDA out of memory (fake)" in timing.failed["raising"]
    assert timing.failed["broken"].startswith("self-check: RuntimeError: output differs")
    (record,) = [r.getMessage() for r in caplog.records if "auto chose" in r.getMessage()]
    assert record.startswith("graph attention auto chose fast for cpu / float32 / rel_key float32 / head dim 16")
    assert "(fast 1 ms, torch 3 ms, slow 5 ms, broken failed: self-check: " in record
    assert record.endswith("raising failed: RuntimeError: CUDA out of memory (fake))")
    assert gpu.fakes["refusing"].calls == 0 and gpu.fakes["broken"].calls > 0


def test_the_second_call_uses_the_memory_and_the_bucket_shares_it(gpu):
    graph, q, k, v, rel = _inputs(30)
    with pytest.warns(RuntimeWarning, match="'broken'"):
        assert _auto(gpu.dispatcher, graph, q, rel) == "fast"
    runs = gpu.timed_runs
    for stored in gpu.cache.iterdir():  # from memory, not from the disk
        stored.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for tokens in (30, 31, 60):  # 63, 65 and 125 nodes: one bucket (<= 256)
            graph, q, k, v, rel = _inputs(tokens)
            assert _auto(gpu.dispatcher, graph, q, rel) == "fast"
    assert gpu.timed_runs == runs and len(gpu.dispatcher.autotuner._timings) == 1


def test_the_bucket_key_separates_sizes_dtypes_head_dims_and_dropout(gpu):
    assert [autotune.size_bucket(n) for n in (1, 256, 257, 512, 513, 20000)] == [256, 256, 512, 512, 1024, 32768]
    with pytest.warns(RuntimeWarning):
        for tokens, dim, dtype, dropout in ((30, 16, torch.float32, 0.0), (200, 16, torch.float32, 0.0),
                                            (30, 16, torch.float64, 0.0), (30, 32, torch.float32, 0.0),
                                            (30, 16, torch.float32, 0.1)):
            graph, q, k, v, rel = _inputs(tokens, dim, dtype)
            _auto(gpu.dispatcher, graph, q, rel, dropout)
    keys = gpu.dispatcher.autotuner._timings
    assert len(keys) == 5
    assert {(key.size_bucket, key.dtype, key.head_dim, key.dropout) for key in keys} == {
        (256, torch.float32, 16, False), (512, torch.float32, 16, False), (256, torch.float64, 16, False),
        (256, torch.float32, 32, False), (256, torch.float32, 16, True)}


def test_a_new_process_reads_the_choice_from_disk(gpu):
    graph, q, k, v, rel = _inputs()
    with pytest.warns(RuntimeWarning):
        assert _auto(gpu.dispatcher, graph, q, rel) == "fast"
    (cache_file,) = gpu.cache.glob("autotune-cpu-*.json")
    stored = json.loads(cache_file.read_text())
    assert stored["versions"]["torch"] == torch.__version__ and len(stored["timings"]) == 1
    # what a new process holds: nothing in memory, no self-checks, a clock that must not run
    script = textwrap.dedent(f"""
        import torch
        from fairseq_plugins.graph_attention import autotune, registry
        from tests.graph_attention.test_graph_attention_autotune import CANDIDATES, Fake, FakeClock, _inputs

        def no_timing(run, device):
            raise AssertionError("timed again")
        clock = FakeClock()
        dispatcher = registry.Dispatcher(auto_candidates=CANDIDATES, timed_devices=("cpu",),
                                         autotuner=autotune.Autotuner({str(gpu.cache)!r}, no_timing))
        for name, ms in (("slow", 5.0), ("raising", 0.1), ("broken", 0.1), ("fast", 1.0), ("torch", 3.0)):
            dispatcher.register(registry.Backend(name, Fake(clock, ms)))
        dispatcher.register(registry.Backend("refusing", Fake(clock, 0.1), lambda *inputs: "no"))
        graph, q, k, v, rel = _inputs()
        print(dispatcher.auto(q, graph, 0.0, rel.dtype), sorted(dispatcher.self_checks))
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    # the stored winner, checked by itself only (no other self-check ran)
    assert result.stdout.split(None, 1) == ["fast", "[('fast', 'cpu', torch.float32, 16, torch.float32)]\n"]


def test_a_corrupt_cache_is_ignored_with_a_warning_and_rewritten(gpu):
    graph, q, k, v, rel = _inputs()
    cache_file = gpu.dispatcher.autotuner.cache_file("cpu")
    cache_file.parent.mkdir(parents=True)
    cache_file.write_text('{"format": 1, "timings": {"x": {"times_ms": ')
    with pytest.warns(RuntimeWarning) as record:
        assert _auto(gpu.dispatcher, graph, q, rel) == "fast"
    assert any("ignoring the graph attention timing cache" in str(w.message) for w in record)
    assert len(json.loads(cache_file.read_text())["timings"]) == 1
    assert [p.name for p in cache_file.parent.iterdir()] == [cache_file.name]  # no temporary file left


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_stored_time_that_is_not_a_finite_number_is_discarded(tmp_path, bad):
    """JSON keeps NaN and Infinity, and NaN would sort first: such an entry is timed again,
    with a warning, and the file's other entries still count."""
    writer = autotune.Autotuner(tmp_path)
    good, poisoned = (autotune.TuningKey("fake", torch.float16, None, 64, size, False) for size in (256, 512))
    writer._write(good, autotune.Timing({"a": 1.0, "b": 2.0}, {}))
    writer._write(poisoned, autotune.Timing({"a": 1.0, "b": bad}, {}))
    reader = autotune.Autotuner(tmp_path)  # a new process: nothing in memory
    with pytest.warns(RuntimeWarning, match=r"ignoring the graph attention timing of .*nodes <= 512.*\{'b': "):
        assert reader.lookup(poisoned) is None
    assert reader.lookup(good).fastest_first(["a", "b"]) == ["a", "b"]


def test_a_stored_winner_that_now_refuses_gives_the_next_fastest(gpu):
    graph, q, k, v, rel = _inputs()
    with pytest.warns(RuntimeWarning):
        assert _auto(gpu.dispatcher, graph, q, rel) == "fast"
    runs = gpu.timed_runs
    gpu.fakes["fast"].refusal = "not today"
    assert _auto(gpu.dispatcher, graph, q, rel) == "torch" and gpu.timed_runs == runs


def test_a_candidate_the_timing_has_not_seen_is_timed(gpu):
    graph, q, k, v, rel = _inputs()
    with pytest.warns(RuntimeWarning):
        assert _auto(gpu.dispatcher, graph, q, rel) == "fast"
    gpu.fakes["refusing"].refusal, gpu.fakes["refusing"].ms = None, 0.5
    assert _auto(gpu.dispatcher, graph, q, rel) == "refusing"


def test_a_backend_without_dropout_is_checked_and_timed_without_it(gpu):
    """Like flex: it refuses dropout, so its self-check leaves dropout out, and with dropout
    on it is not a candidate."""
    fake = gpu.fakes["refusing"]
    fake.refusal, fake.no_dropout, fake.ms = None, True, 0.5
    graph, q, k, v, rel = _inputs()
    with pytest.warns(RuntimeWarning, match="'broken'"):
        assert _auto(gpu.dispatcher, graph, q, rel) == "refusing"
        assert _auto(gpu.dispatcher, graph, q, rel, dropout_p=0.1) == "fast"
    with_dropout = [t for key, t in gpu.dispatcher.autotuner._timings.items() if key.dropout]
    assert "refusing" not in with_dropout[0].times_ms and "refusing" not in with_dropout[0].failed


def test_the_environment_and_an_explicit_backend_override_auto(gpu, monkeypatch):
    graph, q, k, v, rel = _inputs()
    monkeypatch.setenv(registry.BACKEND_ENV, "slow")
    gpu.dispatcher.graph_attention(q, k, v, graph, rel)
    assert gpu.fakes["slow"].calls == 1 and gpu.timed_runs == 0  # no timing, no self-check
    gpu.dispatcher.graph_attention(q, k, v, graph, rel, backend="torch")
    assert gpu.fakes["torch"].calls == 1 and gpu.fakes["slow"].calls == 1
    monkeypatch.setenv(registry.BACKEND_ENV, "refusing")
    with pytest.raises(RuntimeError, match=f"'refusing' \\(named by {registry.BACKEND_ENV}\\) cannot run"):
        gpu.dispatcher.graph_attention(q, k, v, graph, rel)
    monkeypatch.setenv(registry.BACKEND_ENV, "nonsense")
    with pytest.raises(ValueError, match=f"'nonsense' is not registered.*named by {registry.BACKEND_ENV}"):
        gpu.dispatcher.graph_attention(q, k, v, graph, rel)
    monkeypatch.setenv(registry.BACKEND_ENV, "auto")
    with pytest.warns(RuntimeWarning, match="'broken'"):
        gpu.dispatcher.graph_attention(q, k, v, graph, rel)
    assert gpu.timed_runs > 0


def test_timing_excludes_the_warm_up_takes_the_median_and_is_bounded(gpu):
    clock = FakeClock()
    tuner = autotune.Autotuner(gpu.cache, clock.timer, repeats=5, budget_s=1.0, give_up_ratio=4.0)
    costs = {"long": iter([1.0] + [600.0] * 5),  # over the budget after two runs
             "steady": iter([50.0, 2.0, 1.0, 9.0, 1.5, 1.2]),  # warm-up, then median of 5: 1.5
             "hopeless": iter([1.0] + [10.0] * 5)}  # over 4x the best: run once, then dropped
    runs = {name: 0 for name in costs}

    def make_run(name):
        def run():
            runs[name] += 1
            clock.now += next(costs[name]) / 1e3
        return run
    key = autotune.TuningKey("fake", torch.float16, None, 64, 1024, False)
    timing = tuner.tune(key, list(costs), make_run, torch.device("cpu"))
    assert timing.times_ms == pytest.approx({"steady": 1.5, "hopeless": 10.0, "long": 600.0})
    assert runs == {"long": 3, "steady": 6, "hopeless": 2}
    assert timing.fastest_first(costs) == ["steady", "hopeless", "long"]


def test_cpu_tensors_keep_the_untimed_cpu_choice(tmp_path):
    """On CPU there is one fast candidate (flex has no backward there): the GPU candidates
    are not looked at, nothing is timed."""
    clock = FakeClock()
    dispatcher = registry.Dispatcher(auto_candidates=("fast", "torch"),
                                     autotuner=autotune.Autotuner(tmp_path, clock.timer))
    fast = dispatcher.register(registry.Backend("fast", Fake(clock, 0.1))).fn
    graph, q, k, v, rel = _inputs()
    expected = "cpu" if "cpu" in dispatcher.backends else "torch"
    assert _auto(dispatcher, graph, q, rel) == expected and fast.calls == 0 and clock.timed_runs == 0
    assert not list(tmp_path.iterdir())


def test_the_real_timer_synchronizes_and_measures_wall_time():
    import time
    assert autotune.device_time(lambda: time.sleep(0.02), torch.device("cpu")) >= 0.02
