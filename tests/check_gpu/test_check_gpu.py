"""``python -m fairseq_plugins.check_gpu`` without a GPU: its plan (sanitizer commands, the
CUDA group skipped without nvcc), the runner (timeouts, whole logs, progress), the report,
the GPU checks themselves (passing the torch backend and the triton kernels under the
interpreter, failing broken backends), the op benchmark and the model update at tiny sizes,
and the whole command on the CPU."""

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fairseq_plugins.check_gpu import (
    command, headline, kernel_checks, lm_update, model_update, op_benchmark, runner,
)
from fairseq_plugins.check_gpu.cases import TILED_GRAPHS
from fairseq_plugins.graph_attention import graph_attention, register_backend, registry
from fairseq_plugins.graphs.binary_partition import bpt_graph

TINY_BENCHMARK = ["--lengths", "16", "40", "--ks", "1", "2", "--tokens", "64", "--heads", "2",
                  "--head-dim", "16", "--dtype", "float32", "--iters", "2", "--warmup", "1"]
TINY_HEADLINE = ["--n", "16", "--heads", "2", "--head-dim", "32", "--warmup", "1", "--iters", "1"]
TINY_UPDATE = ["--size", "tiny", "--tokens", "64", "--length", "8", "--vocab", "50",
               "--updates", "1", "--dtype", "float32"]
TINY_LM = ["--contexts", "16", "32", "--ks", "2", "--checkpointed-ks", "2", "--recomputed-ks", "--layers", "1",
           "--dim", "16", "--heads", "2", "--tokens", "64", "--updates", "1", "--dtype", "float32",
           "--backend", "torch"]


def args_for(*argv):
    return command.parser().parse_args(list(argv))


# ------------------------------------------------------------------------------ the plan

def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert command.main(["--out", str(tmp_path / "report")]) == command.NO_GPU_EXIT
    assert "no CUDA GPU is visible" in capsys.readouterr().out
    assert not (tmp_path / "report").exists()


def test_without_pytest_it_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert command.main(["--device", "cpu", "--out", str(tmp_path / "report")]) == 1
    assert "pip install pytest" in capsys.readouterr().out and not (tmp_path / "report").exists()


def test_plan_runs_each_group_in_its_own_process_and_sanitizes_triton_and_cuda(tmp_path):
    steps = command.plan(args_for(), "/cuda/bin/compute-sanitizer", "/cuda/bin/nvcc", tmp_path)
    names = [s.name for s in steps]
    assert names == ["headline: sdpa", "headline: flex", "headline: triton", "headline: cuda",
                     "tests: triton", "tests: cuda", "tests: flex", "tests: torch", "tests: auto",
                     "compute-sanitizer memcheck: triton", "compute-sanitizer memcheck: cuda",
                     "op benchmark", "model update", "language-model update"]
    assert all(s.command and s.timeout_s > 0 for s in steps)
    headline, steps = steps[2], steps[4:]  # the headline first, one process per backend, alone
    assert headline.command[2:5] == ["fairseq_plugins.check_gpu.headline", "--backend", "triton"]
    assert headline.command[headline.command.index("--out") + 1] == str(tmp_path / command.HEADLINE_JSON)
    assert not headline.concurrent and headline.env["TRITON_INTERPRET"] is None
    triton = steps[0]
    assert triton.command[-2:] == ["--pyargs", "fairseq_plugins.check_gpu.gpu_tests.test_backend"]
    assert triton.env["FAIRSEQ_PLUGINS_CHECK_BACKEND"] == "triton"
    assert triton.env["TRITON_INTERPRET"] is None  # compiled for the GPU, never interpreted
    assert Path(triton.env["PYTHONPATH"].split(os.pathsep)[0]) == command.PACKAGE.parent
    memcheck = steps[5]
    assert memcheck.command[:7] == ["/cuda/bin/compute-sanitizer", "--tool", "memcheck",
                                    "--error-exitcode", "1", "--target-processes", "all"]
    assert memcheck.command[7:10] == [sys.executable, "-m", "pytest"]
    assert memcheck.env["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1"  # out of bounds = out of an allocation
    assert memcheck.env["FAIRSEQ_PLUGINS_CHECK_SIZE"] == "small"
    assert steps[6].env["FAIRSEQ_PLUGINS_CHECK_BACKEND"] == "cuda"
    op = steps[7].command
    assert op[2] == "fairseq_plugins.check_gpu.op_benchmark"
    start = op.index("--backends") + 1  # the fast backends first, the slow torch reference last
    assert op[start:start + 5] == ["sdpa", "triton", "cuda", "flex", "torch"] == ["sdpa", *registry.AUTO_CANDIDATES]
    assert op[op.index("--out") + 1] == str(tmp_path / "op_benchmark.json")
    lm = steps[9].command
    assert lm[2] == "fairseq_plugins.check_gpu.lm_update" and lm[lm.index("--device") + 1] == "cuda"


def test_without_nvcc_or_sanitizer_their_steps_are_skipped_with_the_reason(tmp_path):
    steps = {s.name: s for s in command.plan(args_for("--benchmark", "none"), None, None, tmp_path)}
    assert steps["tests: cuda"].command is None and "nvcc not found" in steps["tests: cuda"].skip_reason
    assert steps["tests: triton"].command is not None
    for group in ("triton", "cuda"):
        skipped = steps[f"compute-sanitizer memcheck: {group}"]
        assert skipped.command is None and "compute-sanitizer not found" in skipped.skip_reason
    for name in command.BENCHMARK_STEPS + tuple(f"headline: {b}" for b in headline.BACKENDS):
        assert steps[name].command is None and steps[name].skip_reason == "--benchmark none"
    quick = command.plan(args_for("--benchmark", "quick"), None, None, tmp_path)
    op = next(s for s in quick if s.name == "op benchmark").command
    assert "cuda" not in op[op.index("--backends"):] and "8192" in op


def test_nvcc_is_found_where_torch_builds_with_it(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert command.find_nvcc() is None
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    assert command.find_nvcc() == str(tmp_path / "bin" / "nvcc")


def test_the_report_goes_to_the_checkout_benchmarks_else_the_current_folder(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "fairseq_plugins").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    (checkout / "docs").mkdir()
    assert command.default_out_dir(checkout / "docs") == checkout / "benchmarks"
    assert command.default_out_dir(tmp_path) == tmp_path


def test_source_version_without_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setattr(command, "PACKAGE", tmp_path / "fairseq_plugins")
    (tmp_path / "fairseq_plugins").mkdir()
    version = command.source_version()
    assert not version.startswith("commit") and ("installed" in version or "unknown" in version)


# ---------------------------------------------------------------------------- the runner

def python_step(name, code, timeout=60.0, **env):
    return runner.Step(name, [sys.executable, "-c", code], timeout, 1.0, env)


def test_a_step_keeps_its_whole_output_and_its_summary(tmp_path):
    code = "for i in range(200): print('line', i)\nprint('2 passed, 1 skipped in 0.1s')"
    result = runner.run_step(python_step("many lines", code), tmp_path)
    assert result.status == "passed" and result.ok and result.summary() == "2 passed, 1 skipped in 0.1s"
    log = (tmp_path / "many_lines.log").read_text()
    assert "line 0\n" in log and "line 199" in log and log.startswith("$ ")
    assert "line 0\n" not in result.tail and len(result.tail.splitlines()) == runner.TAIL_LINES


def test_a_failing_step_and_the_environment_it_gets(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECK_GPU_TEST_GONE", "1")
    code = ("import os, sys; print(os.environ.get('CHECK_GPU_TEST_GONE'), os.environ['CHECK_GPU_TEST_SET']); "
            "sys.exit(3)")
    result = runner.run_step(python_step("fails", code, CHECK_GPU_TEST_GONE=None, CHECK_GPU_TEST_SET="x"),
                             tmp_path)
    assert result.status == "FAILED (exit 3)" and not result.ok and not result.timed_out
    assert "None x" in result.tail


def test_a_hung_step_and_its_children_are_killed_at_the_timeout(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); "
            "time.sleep(60)")
    start = time.time()
    result = runner.run_step(python_step("hangs", code, timeout=3), tmp_path)
    assert result.timed_out and result.status.startswith("TIMED OUT") and not result.ok
    assert time.time() - start < 30
    assert "started" in result.tail and "killed after the 3 s timeout" in result.tail
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild went with its process group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the step's child process survived the timeout")


def test_progress_says_how_much_is_left_and_forwards_the_steps_progress_lines(tmp_path):
    said = []
    steps = [python_step("first", f"print('{runner.PROGRESS} half way', flush=True)"),
             runner.Step("skipped", None, 10, 500.0, skip_reason="no tool"),
             runner.Step("last", [sys.executable, "-c", "pass"], 10, 30.0)]
    steps[0].estimate_s = 100.0
    progress = runner.Progress(steps, said.append)
    progress.begin(0)
    assert 125 < progress.left() <= 130  # 100 + 30: skipped steps cost nothing
    runner.run_step(steps[0], tmp_path, progress)
    progress.begin(1)
    assert "[2/3] skipped: skipped: no tool" in said[-1]
    assert any("first: half way" in line for line in said)
    assert all(line.startswith("check_gpu 0:00:") and " left: " in line for line in said)


def test_concurrent_steps_run_together_and_the_others_alone(tmp_path):
    """Two concurrent steps that each wait for the other's file pass only when run at once
    (with --jobs 1 they time out); a step that is not concurrent runs after them, alone."""
    def waits_for(mine, other, timeout):
        code = (f"import pathlib, time; pathlib.Path({str(tmp_path / mine)!r}).touch()\n"
                f"while not pathlib.Path({str(tmp_path / other)!r}).exists(): time.sleep(0.05)\n"
                f"print(sorted(p.name for p in pathlib.Path({str(tmp_path)!r}).glob('*.flag')))")
        step = python_step(mine, code, timeout=timeout)
        step.concurrent = True
        return step

    def alone():
        return python_step("alone", f"import pathlib; pathlib.Path({str(tmp_path / 'z.flag')!r}).touch()")

    steps = [waits_for("a.flag", "b.flag", 30), waits_for("b.flag", "a.flag", 30), alone()]
    results = runner.run_steps(steps, tmp_path / "logs", runner.Progress(steps, lambda _: None, jobs=2), jobs=2)
    assert [r.name for r in results] == ["a.flag", "b.flag", "alone"] and all(r.ok for r in results)
    assert "z.flag" not in (tmp_path / "logs" / "a_flag.log").read_text()  # the third ran after them
    for flag in tmp_path.glob("*.flag"):
        flag.unlink()
    steps = [waits_for("a.flag", "b.flag", 2), waits_for("b.flag", "a.flag", 2), alone()]
    results = runner.run_steps(steps, tmp_path / "logs", runner.Progress(steps, lambda _: None), jobs=1)
    assert results[0].timed_out and results[2].ok


def test_a_time_limit_stops_the_running_step_and_skips_the_rest(tmp_path):
    steps = [python_step("sleeps", "import time; time.sleep(60)"), python_step("later", "pass")]
    start = time.time()
    results = runner.run_steps(steps, tmp_path, runner.Progress(steps, lambda _: None), deadline=start + 2)
    assert time.time() - start < 30 and results[0].timed_out
    assert results[1].status == "skipped" and "time limit" in results[1].summary()


def test_jobs_share_the_concurrent_estimates_and_step_timeout_caps_every_step(tmp_path):
    steps = command.plan(args_for("--step-timeout", "120", "--jobs", "2"), "/cuda/bin/compute-sanitizer",
                         "/cuda/bin/nvcc", tmp_path)
    assert all(s.timeout_s <= 120 and s.estimate_s <= 120 for s in steps)
    assert [s.concurrent for s in steps] == [False] * 4 + [True] * 7 + [False] * 3  # the headline alone
    assert command.plan(args_for(), None, "/cuda/bin/nvcc", tmp_path)[4].timeout_s == 3600
    progress = runner.Progress(steps, lambda _: None, jobs=2)
    assert progress.left() == pytest.approx(4 * 90 + 7 * 120 / 2 + 3 * 120, abs=2)
    with pytest.raises(SystemExit):
        command.main(["--jobs", "0"])


# ---------------------------------------------------------------------------- the report

def test_report_on_made_up_results(tmp_path):
    env = {"GPU": "NVIDIA H100 80GB HBM3 (79 GiB, compute capability 9.0)", "torch": "2.13.0"}
    (tmp_path / "logs").mkdir()
    results = [
        runner.StepResult("tests: triton", ["pytest"], 0, 61.0, tmp_path / "logs" / "tests_triton.log",
                          "....\n======= 57 passed, 3 skipped in 60.1s =======\n"),
        runner.StepResult("compute-sanitizer memcheck: triton", ["cs", "python"], 1, 120.0,
                          tmp_path / "logs" / "cs.log",
                          "========= Invalid __global__ read of size 4\n1 failed, 4 passed\n"),
        runner.StepResult("tests: cuda", [], None, 0.0, note="nvcc not found"),
        runner.StepResult("op benchmark", ["python"], -9, 7200.0, tmp_path / "logs" / "op.log", "",
                          timed_out=True),
    ]
    benchmark = {"settings": {"heads": 8, "head_dim": 64, "tokens": 8192, "dtype": "bfloat16",
                              "device": "cuda", "iters": 10, "warmup": 3},
                 "environment": {"gpu": "H100"},
                 "cases": [{"n": 8192, "k": 4, "rows": [
                     {"backend": "sdpa", "dropout": 0.0, "forward_ms": 0.5, "backward_ms": 1.3,
                      "total_ms": 1.8, "status": "ok", "errors": {"output": 1e-3}},
                     {"backend": "triton", "dropout": 0.0, "forward_ms": 0.2, "backward_ms": 0.4,
                      "total_ms": 0.6, "status": "ok", "errors": {"output": 2e-3, "d key": 4e-3},
                      "profile": {"forward": {"launches": 12, "attention_kernels": 1,
                                              "attention_ms": 0.15, "glue_kernels": 11,
                                              "glue_ms": 0.05, "wall_ms": 0.3}}}]}]}
    update = {"settings": {"size": "base", "encoder_layers": 6, "encoder_embed_dim": 512,
                           "sentences": 128, "length": 64, "dtype": "bfloat16", "updates": 5},
              "results": {"transformer": {"status": "ok", "seconds_per_update": 0.1, "vs_transformer": 1.0},
                          "bpt": {"status": "RuntimeError: expected m1 and m2 to have the same dtype"}}}
    report = command.render_report(env, results, benchmark, update, tmp_path)
    assert "| GPU | NVIDIA H100 80GB HBM3" in report and "| torch | 2.13.0 |" in report
    assert ("| tests: triton | passed | 61 s | 57 passed, 3 skipped in 60.1s | "
            "[tests_triton.log](logs/tests_triton.log) |") in report
    assert "| compute-sanitizer memcheck: triton | FAILED (exit 1) | 120 s | 1 failed, 4 passed |" in report
    assert "| tests: cuda | skipped | 0 s | nvcc not found | - |" in report
    assert "| op benchmark | TIMED OUT after 7200 s |" in report
    assert "**Some steps failed.**" in report and "Invalid __global__ read" in report
    assert "| 8192 | 4 | triton | 0.0 | 0.200 | 0.400 | 0.600 | 3.00x | - | 4.00e-03 | ok |" in report
    assert "| 8192 | 4 | triton | 0.0 | forward | 12 | 1 | 0.150 | 11 | 0.050 | 0.300 |" in report
    assert "| bpt | - | - | - | RuntimeError: expected m1 and m2 to have the same dtype |" in report
    data = command.report_json(env, results, benchmark, update, tmp_path)
    assert data["passed"] is False and data["steps"][0]["log"] == "logs/tests_triton.log"
    assert data["steps"][3]["timed_out"] and data["op_benchmark"] is benchmark
    assert command.report_stem(env["GPU"]).startswith("gpu_check_nvidia_h100_80gb_hbm3_")


# ----------------------------------------------------------------- the GPU checks, on CPU

class MaskBug(torch.autograd.Function):
    """The torch backend forward; a backward from a different dropout draw (``other_mask``)
    or none, for the query only (``query_only``) or for every input."""

    @staticmethod
    def forward(ctx, q, k, v, rel, graph, mask, p, backward_p, query_only):
        ctx.save_for_backward(q, k, v, rel)
        ctx.args = graph, mask, p, backward_p, query_only
        ctx.state = torch.get_rng_state()  # what the forward draws its mask from
        return graph_attention(q, k, v, graph, rel, mask, p, backend="torch")

    @staticmethod
    def backward(ctx, grad):
        graph, mask, p, backward_p, query_only = ctx.args
        leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]

        def grads(state, dropout_p):
            with torch.enable_grad(), torch.random.fork_rng():
                torch.set_rng_state(state)
                out = graph_attention(*leaves[:3], graph, leaves[3], mask, dropout_p, backend="torch")
            return torch.autograd.grad(out, leaves, grad)

        right = grads(ctx.state, p)
        wrong = grads(torch.Generator().manual_seed(99).get_state(), backward_p)
        result = (wrong[0], *right[1:]) if query_only else wrong
        return (*result, None, None, None, None, None)


@pytest.fixture
def broken_backends(monkeypatch):
    """The op's dispatcher, for this test, one with wrong backends added (``register_backend``)."""
    monkeypatch.setattr(registry, "DEFAULT", registry.Dispatcher())
    register_backend("off-by-scale", lambda q, k, v, graph, rel, mask, p, scale:
                     graph_attention(q, k, v, graph, rel, mask, p, 1.01 * scale, backend="torch"))
    register_backend("upcast", lambda q, k, v, graph, rel, mask, p, scale:
                     graph_attention(q.float(), k.float(), v.float(), graph, rel.float(), mask, p,
                                     scale, backend="torch"))
    register_backend("no-dropout", lambda q, k, v, graph, rel, mask, p, scale:
                     graph_attention(q, k, v, graph, rel, mask, 0.0, scale, backend="torch"))
    for name, backward_p, query_only in (("other-mask", None, False), ("unmasked-backward", 0.0, False),
                                         ("query-mask", None, True)):
        register_backend(name, lambda q, k, v, graph, rel, mask, p, scale, bp=backward_p, qo=query_only:
                         MaskBug.apply(q, k, v, rel, graph, mask, p, p if bp is None else bp, qo))


def test_the_checks_pass_the_torch_backend():
    build, lengths = TILED_GRAPHS["bpt-k4-n100"]
    for dtype in (torch.float32, torch.bfloat16):
        errors = kernel_checks.check_against_float64("torch", build(), lengths, dtype, 32, "cpu")
        assert set(errors) == set(kernel_checks.NAMES)
        kernel_checks.check_dropout("torch", build(), lengths, dtype, 32, "cpu")
    kernel_checks.check_rows_without_keys("torch", bpt_graph(20, 2), torch.float32, 16, "cpu")


@pytest.mark.parametrize("backend, dtype, match", [
    ("off-by-scale", torch.float32, "vs float64 over"),
    ("upcast", torch.bfloat16, "wrong dtype"),
])
def test_the_float64_check_fails_a_wrong_backend(broken_backends, backend, dtype, match):
    build, lengths = TILED_GRAPHS["bpt-k2-n17"]
    with pytest.raises(AssertionError, match=match):
        kernel_checks.check_against_float64(backend, build(), lengths, dtype, 16, "cpu")


@pytest.mark.parametrize("backend, dtype, match", [
    ("no-dropout", torch.float32, "same mask"),
    ("other-mask", torch.float32, "did not apply the forward's dropout mask"),
    ("other-mask", torch.bfloat16, "did not apply the forward's dropout mask"),
    ("unmasked-backward", torch.bfloat16, "did not apply the forward's dropout mask"),
    ("query-mask", torch.float32, "d query along a random direction"),
])
def test_the_dropout_check_fails_a_wrong_mask(broken_backends, backend, dtype, match):
    build, lengths = TILED_GRAPHS["bpt-k4-n100"]
    with pytest.raises(AssertionError, match=match):
        kernel_checks.check_dropout(backend, build(), lengths, dtype, 32, "cpu")


def test_the_dropout_check_passes_the_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    from tests.triton_interpreter import skip_reason

    if skip_reason():
        pytest.skip(skip_reason())
    build, lengths = TILED_GRAPHS["bpt-k2-n17"]
    kernel_checks.check_dropout("triton", build(), lengths, torch.float32, 32, "cpu")


def test_the_shipped_test_module_runs_from_its_package(tmp_path):
    """What a check_gpu step runs, on the CPU with the torch backend: pytest --pyargs."""
    step = runner.Step("tests: torch", command.pytest_command("test_backend", "-k", "tree_length"), 300,
                       1.0, {**runner.python_env(command.PACKAGE.parent),
                             "FAIRSEQ_PLUGINS_CHECK_BACKEND": "torch",
                             "FAIRSEQ_PLUGINS_CHECK_DEVICE": "cpu", "FAIRSEQ_PLUGINS_CHECK_SIZE": "small"})
    result = runner.run_step(step, tmp_path, cwd=tmp_path)
    assert result.ok, result.tail
    assert result.summary().startswith("20 passed")  # 4 trees x 5 lengths


# ------------------------------------------------------------------ the measurements

def test_split_of_cuda_kernels_into_attention_and_glue():
    cuda = torch.autograd.DeviceType.CUDA

    def kernel(name, us):
        return SimpleNamespace(name=name, device_type=cuda, time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [kernel("forward_kernel", 300.0), kernel("void at::native::vectorized_elementwise_kernel<4>", 20.0),
              kernel("Memset (Device)", 5.0), kernel("triton_poi_fused_copy_0", 10.0),
              kernel("flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", 100.0),
              SimpleNamespace(name="aten::empty", device_type=torch.autograd.DeviceType.CPU)]
    split = op_benchmark.split(events, True, 1.5)
    assert split == {"launches": 5, "attention_kernels": 2, "attention_ms": 0.4, "glue_kernels": 3,
                     "glue_ms": pytest.approx(0.035), "wall_ms": 1.5}


def test_op_benchmark_at_tiny_sizes_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "op.json"
    assert op_benchmark.main(["--out", str(out), "--device", "cpu", "--backends", "sdpa", "torch",
                              "flex", *TINY_BENCHMARK]) == 0
    result = json.loads(out.read_text())
    assert [(c["n"], c["k"]) for c in result["cases"]] == [(16, 1), (16, 2), (40, 1), (40, 2)]
    rows = {(r["backend"], r["dropout"]): r for r in result["cases"][-1]["rows"]}
    for backend in ("sdpa", "torch"):
        for dropout in (0.0, 0.1):
            row = rows[(backend, dropout)]
            assert row["status"] == "ok" and row["forward_ms"] > 0 and row["backward_ms"] > 0
            assert set(row["profile"]) == {"forward", "backward"}
            assert row["profile"]["backward"]["launches"] > 0
        assert max(rows[(backend, 0.0)]["errors"].values()) < 1e-5
        assert "errors" not in rows[(backend, 0.1)]
    assert "no attention dropout" in rows[("flex", 0.1)]["status"]  # flex has no dropout: said, not raised
    table = out.with_suffix(".md").read_text()
    assert "| 40 | 2 | torch | 0.0 |" in table and "Profiler split" in table


def test_op_benchmark_writes_every_row_as_soon_as_it_is_measured(tmp_path, monkeypatch):
    out, real = tmp_path / "op.json", op_benchmark.measure

    def stopped_at_the_second_row(backend, *rest):
        if backend == "torch":
            raise KeyboardInterrupt  # the step's timeout, say
        return real(backend, *rest)
    monkeypatch.setattr(op_benchmark, "measure", stopped_at_the_second_row)
    with pytest.raises(KeyboardInterrupt):
        op_benchmark.main(["--out", str(out), "--device", "cpu", "--backends", "sdpa", "torch", *TINY_BENCHMARK])
    (case,) = json.loads(out.read_text())["cases"]
    assert [row["backend"] for row in case["rows"]] == ["sdpa"]


def test_op_benchmark_error_column_sees_a_wrong_backend(broken_backends):
    args = op_benchmark.parser().parse_args(["--out", "unused", "--device", "cpu", *TINY_BENCHMARK])
    row = op_benchmark.measure("off-by-scale", bpt_graph(16, 1), 16, 0.0, args)
    assert row["status"] == "ok" and max(row["errors"].values()) > 1e-3


def test_model_update_reports_a_failing_model_and_times_the_others(tmp_path, monkeypatch):
    monkeypatch.setitem(model_update.MODELS, "broken", ("no_such_arch", {}))
    out = tmp_path / "models.json"
    code = model_update.main(["--out", str(out), "--device", "cpu", "--models", "transformer", "bpt",
                              "broken", *TINY_UPDATE])
    assert code == 1
    results = json.loads(out.read_text())["results"]
    assert results["transformer"]["vs_transformer"] == 1.0 and results["bpt"]["status"] == "ok"
    assert results["bpt"]["seconds_per_update"] > 0 and results["broken"]["status"].startswith("KeyError")


@pytest.mark.cli
@pytest.mark.slow
def test_the_whole_command_on_the_cpu(tmp_path, capsys):
    argv = ["--device", "cpu", "--groups", "torch", "--size", "small", "--benchmark", "quick",
            "--out", str(tmp_path / "out"), *[f"--benchmark-option={o}" for o in TINY_BENCHMARK],
            "--benchmark-option=--backends", "--benchmark-option=sdpa", "--benchmark-option=torch",
            *[f"--update-option={o}" for o in TINY_UPDATE],
            "--update-option=--models", "--update-option=transformer", "--update-option=segtree",
            *[f"--lm-option={o}" for o in TINY_LM], *[f"--headline-option={o}" for o in TINY_HEADLINE]]
    assert command.main(argv) == 0
    console = capsys.readouterr().out
    assert "[5/8] tests: torch: running" in console and "case 4/4 (n 40, k 2) done" in console
    stem = command.report_stem("none")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"{stem}.json", f"{stem}.md",
                                                                    f"{stem}_logs"]
    data = json.loads((tmp_path / "out" / f"{stem}.json").read_text())
    assert data["passed"] and [s["status"] for s in data["steps"]] == ["passed"] * 8
    assert [row["backend"] for row in data["headline"]["rows"]] == list(headline.BACKENDS)
    assert data["op_benchmark"]["cases"][0]["rows"][0]["backend"] == "sdpa"
    assert set(data["model_update"]["results"]) == {"transformer", "segtree"}
    assert set(data["lm_update"]["results"]) == {"transformer_lm", "bpt_lm k2", "bpt_lm k2 checkpointed"}
    for step in data["steps"]:
        assert (tmp_path / "out" / step["log"]).read_text().startswith("$ ")
    report = (tmp_path / "out" / f"{stem}.md").read_text()
    assert "## Graph attention per op" in report and "## One training update per model" in report
    assert "## Language models at long context" in report and "| bpt_lm k2 checkpointed | 32 |" in report


def test_benchmark_headline_runs_the_headline_then_the_tests_and_nothing_else(tmp_path):
    steps = command.plan(args_for("--benchmark", "headline"), "/cuda/bin/compute-sanitizer", "/cuda/bin/nvcc",
                         tmp_path)
    ran = [s.name for s in steps if s.command]
    assert ran[:4] == [f"headline: {b}" for b in ("sdpa", "flex", "triton", "cuda")]
    assert ran[4:] == [s.name for s in steps if s.name.startswith(("tests:", "compute-sanitizer"))]
    for name in command.BENCHMARK_STEPS:
        assert next(s for s in steps if s.name == name).skip_reason == "--benchmark headline"


def test_a_headline_row_is_added_as_soon_as_it_is_measured(tmp_path):
    out = tmp_path / "headline.json"
    options = ["--out", str(out), "--device", "cpu", "--dtype", "float32", *TINY_HEADLINE]
    assert headline.main(["--backend", "sdpa", *options]) == 0
    assert [row["backend"] for row in json.loads(out.read_text())["rows"]] == ["sdpa"]
    assert headline.main(["--backend", "cuda", *options]) == 0
    assert headline.main(["--backend", "sdpa", *options]) == 0  # again: replaces its row
    rows = json.loads(out.read_text())["rows"]
    assert [row["backend"] for row in rows] == ["cuda", "sdpa"] and rows[1]["status"] == "ok"
    assert rows[0]["status"] == "refused: CUDA tensors only, got cpu"
    with pytest.raises(SystemExit, match="holds rows of other settings"):
        headline.main(["--backend", "sdpa", *options, "--k", "2"])


def test_the_headline_gives_speedups_over_sdpa_and_flex_on_wall_and_kernel_time():
    def row(backend, total, kernels):
        return {"backend": backend, "forward_ms": total / 2, "backward_ms": total / 2, "total_ms": total,
                "kernel_ms": kernels, "status": "ok"}
    settings = {"n": 8192, "k": 4, "dtype": "bfloat16", "heads": 8, "head_dim": 64, "device": "cuda",
                "iters": 10, "warmup": 3}
    table = headline.markdown({"settings": settings, "environment": {"gpu": "H100"}, "rows": [
        row("sdpa", 2.0, 1.6), row("flex", 1.0, 0.6), row("triton", 0.5, 0.2),
        {"backend": "cuda", "status": "refused: no nvcc"}]})
    assert "| vs SDPA (wall) | vs flex (wall) | GPU-kernel ms | vs SDPA (kernels) | vs flex (kernels) |" in table
    assert "| triton | 0.250 | 0.250 | 0.500 | 4.00x | 2.00x | 0.200 | 8.00x | 3.00x | - | ok |" in table
    assert "| cuda | - | - | - | - | - | - | - | - | - | refused: no nvcc |" in table


@pytest.mark.cli
@pytest.mark.slow
def test_the_headline_dry_run_of_the_whole_command_on_the_cpu(tmp_path, monkeypatch):
    """Every headline backend gets a row: measured where it runs on a CPU (triton under the
    interpreter), else with the reason; the headline comes before the tests."""
    from tests.triton_interpreter import skip_reason

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = ["--device", "cpu", "--benchmark", "headline", "--groups", "torch", "--size", "small",
            "--out", str(tmp_path), *[f"--headline-option={o}" for o in TINY_HEADLINE]]
    assert command.main(argv) == 0
    data = json.loads((tmp_path / f"{command.report_stem('none')}.json").read_text())
    assert [s["name"] for s in data["steps"] if s["status"] != "skipped"] == [
        "headline: sdpa", "headline: flex", "headline: triton", "headline: cuda", "tests: torch"]
    rows = {row["backend"]: row for row in data["headline"]["rows"]}
    assert list(rows) == list(headline.BACKENDS)
    assert rows["sdpa"]["status"] == "ok" and rows["sdpa"]["kernel_ms"] > 0
    if skip_reason():
        assert rows["triton"]["status"] == f"refused: {skip_reason()}"
    else:
        assert rows["triton"]["status"] == "ok" and max(rows["triton"]["errors"].values()) < 5e-2
    assert rows["flex"]["status"].startswith("NotImplementedError: FlexAttention does not support backward on CPU")
    assert rows["cuda"]["status"] == "refused: CUDA tensors only, got cpu"
    report = (tmp_path / f"{command.report_stem('none')}.md").read_text()
    assert "## The headline: graph attention against SDPA and flex" in report and "CPU op (no GPU) ms" in report
    assert "| cuda | - | - | - | - | - | - | - | - | - | refused: CUDA tensors only, got cpu |" in report


def test_lm_update_reports_a_failing_model_and_times_the_others(tmp_path, monkeypatch):
    """A model that fails at one context (out of memory, say) is reported there; the others,
    and its other contexts, are timed."""
    real = lm_update.lm_update_step

    def failing_at_32(model, tokens, context, autocast_dtype=None):
        step = real(model, tokens, context, autocast_dtype)
        is_bpt = hasattr(model.decoder, "_spec")
        if is_bpt and context == 32:
            def step():
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return step
    monkeypatch.setattr(lm_update, "lm_update_step", failing_at_32)
    out = tmp_path / "lm.json"
    assert lm_update.main(["--out", str(out), "--device", "cpu", *TINY_LM, "--checkpointed-ks"]) == 1
    results = json.loads(out.read_text())["results"]
    assert results["transformer_lm"]["32"]["status"] == "ok" and results["bpt_lm k2"]["16"]["status"] == "ok"
    assert results["bpt_lm k2"]["32"]["status"].startswith("OutOfMemoryError: CUDA out of memory")
    assert results["bpt_lm k2"]["16"]["tokens_per_second"] > 0
    table = lm_update.markdown(json.loads(out.read_text()))
    assert "| bpt_lm k2 | 32 | - |" in table and "| transformer_lm | 32 |" in table
