"""``python -m fairseq_plugins.check_gpu`` without a GPU: it says so and writes nothing; its
plan and its Markdown report, checked on made-up results."""

from pathlib import Path

import torch

from fairseq_plugins import check_gpu


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.md"
    assert check_gpu.main(["--out", str(out)]) == check_gpu.NO_GPU_EXIT
    assert "no CUDA GPU is visible" in capsys.readouterr().out
    assert not out.exists()


def test_plan_skips_a_missing_sanitizer_and_the_benchmark_on_request():
    steps = check_gpu.plan("none", None, Path("bench"))
    assert [s.name for s in steps] == ["GPU tests", "compute-sanitizer memcheck",
                                       "compute-sanitizer initcheck", "benchmark"]
    assert steps[0].command[-4:] == ["-m", "gpu", "-q", "-rs", "tests"][-4:]
    assert all(s.command is None for s in steps[1:]) and "not found" in steps[1].note
    with_all = check_gpu.plan("quick", "/cuda/bin/compute-sanitizer", Path("bench"))
    assert with_all[1].command[:3] == ["/cuda/bin/compute-sanitizer", "--tool", "memcheck"]
    assert with_all[3].command[-2:] == ["--out", "bench"] and "8192" in with_all[3].command


def test_report_on_made_up_results():
    env = {"GPU": "NVIDIA H100 80GB HBM3 (79 GiB, compute capability 9.0)", "torch": "2.13.0"}
    steps = [
        check_gpu.StepResult("GPU tests", ["pytest"], 0, 61.0,
                             "....\n======= 57 passed, 3 skipped in 60.1s =======\n"),
        check_gpu.StepResult("compute-sanitizer memcheck", ["cs"], 1, 120.0,
                             "========= Invalid __global__ read of size 4\n1 failed, 4 passed\n"),
        check_gpu.run_step("compute-sanitizer initcheck", None, "not found"),
    ]
    report = check_gpu.render_report(env, steps, "| n | cuda ms |\n|---|---|\n| 8192 | 12.5 |\n")
    assert "| GPU | NVIDIA H100 80GB HBM3" in report and "| torch | 2.13.0 |" in report
    assert "| GPU tests | passed | 61 s | 57 passed, 3 skipped in 60.1s |" in report
    assert "| compute-sanitizer memcheck | FAILED (exit 1) | 120 s | 1 failed, 4 passed |" in report
    assert "| compute-sanitizer initcheck | skipped | 0 s | not found |" in report
    assert "**Some steps failed.**" in report and "Invalid __global__ read" in report
    assert "## Benchmark" in report and "| 8192 | 12.5 |" in report
    assert check_gpu.report_path(env["GPU"], Path("b")).name.startswith(
        "gpu_check_nvidia_h100_80gb_hbm3_")


def test_a_step_runs_its_command_and_keeps_the_output():
    import sys

    step = check_gpu.run_step("echo", [sys.executable, "-c", "print('2 passed in 0.1s')"])
    assert step.status == "passed" and step.summary() == "2 passed in 0.1s"
