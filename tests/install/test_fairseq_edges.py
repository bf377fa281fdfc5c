"""The edges fairseq users meet: several processes, a missing --user-dir, GPU-only flags on CPU."""

import argparse
import importlib
import os
import shutil
import sys
import subprocess

import pytest
import torch
from omegaconf import OmegaConf

from fairseq import models, options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.trainer import Trainer

from tests.cli import REPO, TINY_MODEL_ARGS, run_cli, train, train_args
from tests.models.test_checkpoint_compat import FIXTURES

DISTRIBUTED_CPU = ["--ddp-backend", "c10d", "--distributed-backend", "gloo"]


@pytest.mark.slow
def test_two_cpu_processes_under_torchrun_train_in_lockstep(tiny_data_bin, tmp_path):
    """torchrun (this environment's, `python -m torch.distributed.run`) + fairseq-train (c10d,
    gloo): both ranks see world size 2 and end with the same parameters, which only the
    gradient all-reduce explains (each rank reads its own shard)."""
    args = train_args(tiny_data_bin, tmp_path / "ckpt", "bpt_transformer", DISTRIBUTED_CPU, max_update=3)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "tests/distributed_probe.py", *map(str, [tmp_path, *args])],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["num_updates"] for r in ranks] == [3, 3]
    assert ranks[0]["params"].keys() == ranks[1]["params"].keys()
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


@pytest.mark.cli
@pytest.mark.slow
def test_torchrun_processes_without_a_gpu_are_told_to_add_cpu(tmp_path):
    """Without --cpu, each process would start NCCL and die in three tracebacks ('NCCL not built
    in'); each says in one line to add --cpu, and torchrun's own summary quotes that line."""
    args = [arg for arg in train_args(tmp_path, tmp_path / "ckpt", "transformer") if arg != "--cpu"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         shutil.which("fairseq-train"), *map(str, args)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES=""),
    )  # fmt: skip
    line = ("fairseq-train: error: the processes started by torchrun use the NCCL backend, which needs GPUs, and "
            "this machine has none: add --cpu to run the processes on CPU (gloo), or use a machine with GPUs")
    assert proc.returncode != 0
    # each process prints the line (torchrun may stop one before it does)
    assert f"\n{line}\n" in f"\n{proc.stderr}", proc.stderr[-3000:]
    assert f"traceback : {line}\n" in proc.stderr, proc.stderr[-3000:]
    # torchrun's traceback, none of fairseq's
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-3000:]
    assert "NCCL built in" not in proc.stderr


@pytest.mark.slow
def test_fairseq_spawns_one_process_per_rank_on_cpu(tiny_data_bin, tmp_path):
    """`--distributed-world-size 2 --cpu`: fairseq's own spawn, no launcher; the backend is
    left to its default (NCCL, which needs GPUs), so gloo is picked and said."""
    log = train(tiny_data_bin, tmp_path, "bpt_transformer", ["--distributed-world-size", "2", "--ddp-backend", "c10d"],
                max_update=3).stdout  # fmt: skip
    assert "--cpu: distributed backend gloo (NCCL needs GPUs)" in log, log[-3000:]
    assert "distributed init (rank 0)" in log and "distributed init (rank 1)" in log, log[-3000:]
    assert "training on 2 devices" in log and "done training" in log, log[-3000:]


def test_an_unknown_model_type_names_itself_and_user_dir():
    cfg = argparse.Namespace(arch="a_plugin_model", note="{braces} broke the old message {0}")
    with pytest.raises(ValueError, match=r"unknown model type 'a_plugin_model'.*--user-dir"):
        models.build_model(cfg, task=None)


def test_an_unknown_task_names_itself_and_user_dir():
    with pytest.raises(ValueError, match=r"unknown task 'a_plugin_task'.*--user-dir"):
        tasks.setup_task(OmegaConf.create({"_name": "a_plugin_task", "note": "{}"}))


@pytest.mark.slow
def test_translating_with_a_plugin_checkpoint_without_user_dir_says_so():
    folder = FIXTURES / "bpt_transformer"
    with pytest.raises(RuntimeError) as err:
        run_cli("fairseq-interactive", folder, "--path", folder / "checkpoint.pt", "--source-lang", "en",
                "--target-lang", "de", "--cpu", input="the man .\n")  # fmt: skip
    assert "unknown model type 'bpt_transformer'" in str(err.value) and "--user-dir" in str(err.value)


def _trainer(data_bin, *flags):
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data_bin), "--arch", "transformer", *TINY_MODEL_ARGS, "--optimizer", "adam", "--lr", "0.001",
        "--max-tokens", "500", "--cpu", *flags,
    ])  # fmt: skip
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    return Trainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))


def test_fp16_on_cpu_is_refused_before_training(tiny_data_bin):
    with pytest.raises(ValueError, match="--fp16 needs a CUDA GPU; on CPU, train in float32"):
        _trainer(tiny_data_bin, "--fp16")


@pytest.mark.parametrize("command", ["generate", "interactive"])
@pytest.mark.parametrize("flag, message", [
    ("--fp16", "--fp16 needs a CUDA GPU; on CPU, decode in float32"),
    ("--bf16", "--bf16: fairseq 0.12.2 does not decode in bfloat16"),
])  # fmt: skip
def test_half_precision_decoding_on_cpu_is_refused_before_loading(command, flag, message):
    """fairseq-generate/-interactive would run --fp16 in float16 on CPU and ignore --bf16."""
    module = importlib.import_module(f"fairseq_cli.{command}")
    interactive = command == "interactive"
    parser = options.get_interactive_generation_parser() if interactive else options.get_generation_parser()
    folder = FIXTURES / "bpt_transformer"
    args = options.parse_args_and_arch(parser, [str(folder), "--path", str(folder / "checkpoint.pt"), "--cpu", flag])
    with pytest.raises(ValueError, match=message):
        module.main(convert_namespace_to_omegaconf(args))


@pytest.mark.parametrize("flag", ["--bf16", "--memory-efficient-bf16"])
def test_bf16_without_torch_xla_is_refused_before_training(tiny_data_bin, flag):
    """fairseq 0.12.2 trains bfloat16 on TPUs only: --bf16 implies --tpu."""
    with pytest.raises(ValueError, match="--tpu, which --bf16 .* imply in fairseq 0.12.2, needs torch_xla"):
        _trainer(tiny_data_bin, flag)


@pytest.mark.parametrize("flag, warning", [("--amp", "--amp does nothing on CPU"),
                                           ("--memory-efficient-fp16", "trains in float16, which is slow")])
def test_mixed_precision_flags_on_cpu_warn(tiny_data_bin, flag, warning, caplog):
    _trainer(tiny_data_bin, flag)
    assert warning in caplog.text


@pytest.mark.slow
def test_tensorboard_logdir_writes_the_training_curves(tiny_data_bin, tmp_path):
    """--tensorboard-logdir, through the project's `tensorboard` extra."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tiny_data_bin, tmp_path / "ckpt", "ms_transformer", ["--tensorboard-logdir", tmp_path / "tb", "--no-save"],
          max_update=2)  # fmt: skip
    for split in ("train", "valid"):
        events = EventAccumulator(str(tmp_path / "tb" / split))
        events.Reload()
        assert "loss" in events.Tags()["scalars"], (split, events.Tags())
