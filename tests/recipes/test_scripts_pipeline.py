"""Train -> average -> generate -> detokenize -> sacrebleu -> table, and the demo, on tiny
Multi30K subsets with the real fairseq console scripts (seconds per model on a CPU)."""

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fairseq_plugins.recipes import average_checkpoints, demo, evaluate, train
from fairseq_plugins.recipes.config import load_config
from tests.cli import MULTI30K
from tests.table_files import one_row_table

TINY_MODEL = {"encoder-layers": 1, "decoder-layers": 1, "encoder-embed-dim": 32, "decoder-embed-dim": 32,
              "encoder-ffn-embed-dim": 64, "decoder-ffn-embed-dim": 64, "encoder-attention-heads": 2,
              "decoder-attention-heads": 2, "share-all-embeddings": True}


@pytest.fixture(scope="module")
def multi30k_bin(tmp_path_factory):
    """300 training pairs, 20 valid/test pairs, 300 BPE merges, with raw references."""
    return demo.prepare_multi30k(MULTI30K, tmp_path_factory.mktemp("m30k") / "data-bin", 300,
                                 limit=300, test_limit=20)


def _fake_checkpoint(path: Path, value: float, step: int, updates: int = 0):
    torch.save({"model": {"w": torch.full((2,), value), "version": torch.tensor([step])},
                "cfg": {"epoch": step}, "optimizer_history": [{"num_updates": updates}]}, path)


def test_average_last_epochs_numeric_order_and_mean(tmp_path):
    for epoch, value in [(2, 100.0), (9, 1.0), (10, 3.0), (11, 5.0)]:
        _fake_checkpoint(tmp_path / f"checkpoint{epoch}.pt", value, step=7, updates=100 * epoch)
    _fake_checkpoint(tmp_path / "checkpoint_last.pt", 1000.0, step=7, updates=1100)  # = epoch 11's
    out = average_checkpoints.main([str(tmp_path), "--last", "3", "--output", str(tmp_path / "avg.pt")])
    state = torch.load(out, weights_only=False)
    assert torch.equal(state["model"]["w"], torch.full((2,), 3.0))  # mean of epochs 9, 10, 11
    assert state["cfg"] == {"epoch": 7} and state["model"]["w"].dtype == torch.float32
    with pytest.raises(FileNotFoundError, match="found 4"):
        average_checkpoints.last_checkpoints(tmp_path, 5)


def test_average_includes_a_final_partial_epoch(tmp_path):
    """--max-update stops inside epoch 12: its state is only in checkpoint_last.pt."""
    for epoch, value in [(10, 3.0), (11, 5.0)]:
        _fake_checkpoint(tmp_path / f"checkpoint{epoch}.pt", value, step=7, updates=100 * epoch)
    _fake_checkpoint(tmp_path / "checkpoint_last.pt", 10.0, step=7, updates=1150)
    assert [p.name for p in average_checkpoints.last_checkpoints(tmp_path, 2)] == ["checkpoint11.pt",
                                                                                  "checkpoint_last.pt"]
    out = average_checkpoints.main([str(tmp_path), "--last", "3", "--output", str(tmp_path / "avg.pt")])
    assert torch.equal(torch.load(out, weights_only=False)["model"]["w"], torch.full((2,), 6.0))


def test_average_rejects_differing_integer_buffers(tmp_path):
    _fake_checkpoint(tmp_path / "a.pt", 1.0, step=1)
    _fake_checkpoint(tmp_path / "b.pt", 2.0, step=2)
    with pytest.raises(ValueError, match="version differs"):
        average_checkpoints.average([tmp_path / "a.pt", tmp_path / "b.pt"])


def test_train_command_scales_batch_and_passes_distributed_flags(tmp_path):
    cfg = load_config("bpt-table7:bpt-k4")
    data = tmp_path / "data"
    four = train.build_command(cfg, data, tmp_path / "run", gpus_per_node=4, extra=["--max-update", "5"])
    assert four[four.index("--update-freq") + 1] == "2"  # 8 GPUs in the paper
    assert four[four.index("--distributed-world-size") + 1] == "4" and four[-2:] == ["--max-update", "5"]
    cpu = train.build_command(cfg, data, tmp_path / "run", gpus_per_node=0)
    assert "--cpu" in cpu and "--distributed-world-size" not in cpu
    nodes = train.build_command(cfg, data, tmp_path / "run", gpus_per_node=8, nnodes=2, node_rank=1,
                                master_addr="10.0.0.1")
    assert nodes[0].endswith("torchrun") and nodes[1:6] == ["--nproc_per_node=8", "--nnodes=2", "--node_rank=1",
                         "--master_addr=10.0.0.1", "--master_port=29500"]
    assert nodes[nodes.index("--distributed-world-size") + 1] == "16"
    with pytest.raises(ValueError, match="master-addr"):
        train.build_command(cfg, data, tmp_path / "run", gpus_per_node=8, nnodes=2)


@pytest.mark.cli
@pytest.mark.slow
def test_config_trains_averages_and_scores_with_sacrebleu(multi30k_bin, tmp_path):
    row = one_row_table(
        tmp_path / "tiny.yaml", row="Transformer (our implementation)",
        reported={"sacrebleu": 27.2}, data="multi30k-en-de", arch="transformer",
        task={"task": "translation"}, model=TINY_MODEL,
        train={"optimizer": "adam", "lr": 0.005, "lr-scheduler": "inverse_sqrt", "warmup-updates": 5,
               "criterion": "label_smoothed_cross_entropy", "label-smoothing": 0.1,
               "max-tokens": 1500, "max-epoch": 3, "num-workers": 0, "seed": 1},
        gpus=1, average_last=2, generate={"beam": 2, "batch-size": 32, "max-len-b": 10})
    runs = tmp_path / "runs"
    save_dir = train.main([row, "--data", str(multi30k_bin), "--runs-dir", str(runs),
                           "--world-size", "0", "--", "--no-progress-bar"])
    assert sorted(p.name for p in save_dir.glob("checkpoint[0-9]*.pt")) == \
        ["checkpoint1.pt", "checkpoint2.pt", "checkpoint3.pt"]
    result = evaluate.main([row, "--data", str(multi30k_bin), "--runs-dir", str(runs),
                            "--results-dir", str(tmp_path / "results")])
    assert result["checkpoint"].endswith("checkpoint_avg2.pt") and result["sentences"] == 20
    assert 0.0 <= result["sacrebleu"] <= 100.0 and result["sacrebleu_signature"].startswith("nrefs:1|case:mixed")
    assert "tok:none" in result["tokenized_signature"]
    saved = json.loads((tmp_path / "results" / "test-table" / "tiny.json").read_text())
    assert saved["sacrebleu"] == result["sacrebleu"] and saved["data"] == str(multi30k_bin)
    work = tmp_path / "results" / "test-table" / "tiny"
    hyp_detok = (work / "test.hyp.detok.de").read_text(encoding="utf-8").splitlines()
    assert len(hyp_detok) == 20 and not any("@@" in h for h in hyp_detok)


@pytest.mark.cli
def test_generate_output_ids_must_cover_the_references(multi30k_bin, tmp_path):
    partial = "S-0\tx\nH-0\t-1.0\tein Hund\nD-0\t-1.0\tein Hund\n"
    with pytest.raises(ValueError, match="1 hypotheses for 20 references"):
        evaluate.score(partial, multi30k_bin, "test", tmp_path)


DEMO_TINY = ["--updates", "6", "--archs", "transformer", "--train-sentences", "300", "--test-sentences", "20",
             "--raw-dir", str(MULTI30K), "--threads", "1", "--log-interval", "1", "--progress-interval", "0"]


def _run_demo(out: Path):
    """The demo in its reduced mode; returns its rows and what it wrote to stderr (not a TTY)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rows = demo.main(DEMO_TINY + ["--out", str(out)])
    return rows, err.getvalue()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    # a previous demo's run folder: a re-run starts fresh (fairseq would try to resume from it)
    stale = out / "runs" / demo.run_name({"name": "Transformer"}) / "checkpoint_last.pt"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"a checkpoint of an earlier run")
    return out, *_run_demo(out)


def _losses(run_dir: Path):
    return re.findall(r"train_inner \|.* loss=([\d.]+)", (run_dir / "train.log").read_text())


@pytest.mark.slow
@pytest.mark.cli
def test_demo_reduced_mode_writes_table_and_plot(demo_run):
    out, rows, progress = demo_run
    assert [r["arch"] for r in rows] == ["transformer"]
    assert rows[0]["params"] > 0 and rows[0]["updates"] == 6 and rows[0]["words_per_second"] > 0
    assert rows[0]["seconds_per_update"] > 0 and rows[0]["relative_time"] == 1.0  # it is the baseline
    table = (out / "demo.md").read_text()
    assert "6 updates per model (seed 1)" in table and "sacrebleu signature" in table
    assert "| Transformer | `transformer` |" in table and table.rstrip().splitlines()[-3].endswith("| 1.00x |")
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "demo.json").read_text())
    assert saved["rows"][0]["sacrebleu"] == rows[0]["sacrebleu"] and saved["run"]["threads"] == 1
    assert len(_losses(out / "runs" / "transformer")) == 6  # trained from scratch, not resumed


@pytest.mark.slow
@pytest.mark.cli
def test_demo_progress_is_line_based_when_not_a_tty(demo_run):
    _, _, progress = demo_run
    assert "\r" not in progress
    lines = [line for line in progress.splitlines() if line.startswith("[demo] ")]
    assert "[demo] 1/1 Transformer: training 6/6 updates" in progress
    assert any(": translating 6/6 updates" in line for line in lines)
    assert lines[-1].startswith("[demo] 1/1 Transformer: done 6/6 updates; ETA 0:00")


@pytest.mark.slow
@pytest.mark.cli
def test_demo_fixed_updates_give_the_same_result_on_a_busy_machine(demo_run, tmp_path):
    out, rows, _ = demo_run
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # competes for the CPU
    try:
        shutil.copytree(out / "data-bin", tmp_path / "data-bin")  # the same data, prepared once
        again, _ = _run_demo(tmp_path)
    finally:
        busy.kill()
        busy.wait()
    assert again[0]["updates"] == rows[0]["updates"] == 6
    assert again[0]["sacrebleu"] == rows[0]["sacrebleu"] and again[0]["tokenized"] == rows[0]["tokenized"]
    assert _losses(tmp_path / "runs" / "transformer") == _losses(out / "runs" / "transformer")
    hyps = "test.hyp.detok.de"
    assert (tmp_path / "runs" / "transformer" / hyps).read_text() == (out / "runs" / "transformer" / hyps).read_text()


def test_parse_train_log_requires_params_and_progress():
    head = "2026-01-01 | INFO | fairseq_cli.train | num. shared model params: 12,345 (num. trained: 12,345)\n"
    inner = ("| INFO | train_inner | epoch 001:      2 / 5 loss=9.1, wps=100, ups=1, num_updates=2\n"
             "| INFO | train_inner | epoch 001:      4 / 5 loss=9.0, wps=300, ups=1, num_updates=4\n")
    valid = "| INFO | valid | epoch 001 | valid on 'valid' subset | loss 9 | wps 5000.0 | wpb 4 | num_updates 5\n"
    summary = "| INFO | train | epoch 001 | loss 9.0 | wps 250.0 | ups 2 | num_updates 5 | wall 3\n"
    assert demo.parse_train_log(head + inner + valid + summary) == \
        {"params": 12345, "updates": 5, "words_per_second": 200.0}
    assert demo.parse_train_log(head + valid + summary) == \
        {"params": 12345, "updates": 5, "words_per_second": 250.0}
    with pytest.raises(ValueError, match="num. model params"):
        demo.parse_train_log("epoch 001 | wps 1 | num_updates 1")


def test_chinese_target_is_joined_and_scored_with_the_zh_tokenizer(tmp_path):
    data = tmp_path / "data"
    (data / "text").mkdir(parents=True)
    (data / "prep.json").write_text(json.dumps({"corpus": "toy", "target_lang": "zh", "lowercase": False}))
    references = ["这是一个关于海洋的故事。", "我用iPhone拍了照片。"]
    (data / "test.raw.zh").write_text("".join(r + "\n" for r in references), encoding="utf-8")
    (data / "text" / "test.zh").write_text("这是 一个 关于 海@@ 洋 的 故事 。\n我 用 iPhone 拍 了 照片 。\n",
                                           encoding="utf-8")
    out = "D-0\t-0.1\t这是 一个 关于 海洋 的 故事 。\nD-1\t-0.2\t我 用 iPhone 拍 了 照片 。\n"
    result = evaluate.score(out, data, "test", tmp_path / "work")
    assert "tok:zh" in result["sacrebleu_signature"] and result["sacrebleu"] == pytest.approx(100.0)
    assert result["tokenized"] == pytest.approx(100.0) and "tok:none" in result["tokenized_signature"]
    assert (tmp_path / "work" / "test.hyp.detok.zh").read_text(encoding="utf-8").splitlines()[0] == references[0]
    assert result["test_set"] == "toy test (prepared by fairseq-plugins-prepare-data)"
    named = evaluate.score(out, data, "test", tmp_path / "work", tokenize="char")
    assert "tok:char" in named["sacrebleu_signature"]
