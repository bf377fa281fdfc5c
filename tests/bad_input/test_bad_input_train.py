"""fairseq-train under bad options and bad data: refused in one line before the first update,
nothing saved."""

import shutil
from pathlib import Path

import pytest

from tests.bad_input import refusal, sole_line
from tests.classification_data import write_classification, write_tagging
from tests.cli import USER_DIR, run_cli, train_args
from tests.lm_fixture import ARCHS, TINY
from tests.tasks.classification.test_classification import SENTENCE_ARGS
from tests.tasks.classification.test_classification import TINY as CLASSIFIER


def _train_lm(data, save, *extra):
    return ["fairseq-train", data, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "bpt_lm", *TINY,
            *ARCHS["bpt_lm"], "--max-tokens", "512", "--optimizer", "adam", "--lr", "0.003", "--max-update", "2",
            "--save-dir", save, "--cpu", "--num-workers", "0", *extra]


@pytest.mark.slow
def test_an_lm_graph_k_is_bounded_by_its_tokens_per_sample(enwik8_bin, tmp_path):
    line = sole_line(*_train_lm(enwik8_bin, tmp_path / "ckpt", "--graph-k", "100"))
    assert line.startswith("fairseq-train: error: --graph-k 100 is beyond what can help: at k = 63 "
                           "(the longest sequence, --tokens-per-sample 64, minus one)"), line
    assert line.endswith("Use --graph-k <= 63"), line
    assert not list((tmp_path / "ckpt").glob("*.pt"))  # fairseq-train makes the folder first, empty


@pytest.fixture(scope="module")
def tagging_data(tmp_path_factory):
    return write_tagging(tmp_path_factory.mktemp("tagging"))


@pytest.fixture(scope="module")
def sentence_data(tmp_path_factory):
    return write_classification(tmp_path_factory.mktemp("sentences"))


def with_bad_valid_label(data: Path, out: Path, bad: str) -> Path:
    """A copy of ``data`` whose valid split's first label (tag) is ``bad``, binarized with train's
    label dictionary as fairseq-preprocess --srcdict does: an unknown one becomes <unk>."""
    shutil.copytree(data, out)
    raw = data.parent / "raw"
    lines = (raw / "valid.label").read_text().splitlines()
    lines[0] = " ".join([bad, *lines[0].split()[1:]])
    (out / "valid.label").write_text("".join(line + "\n" for line in lines))
    run_cli("fairseq-preprocess", "--only-source", "--srcdict", data / "label" / "dict.txt", "--validpref",
            out / "valid.label", "--destdir", out / "rebinarized", "--workers", "1")
    for suffix in (".bin", ".idx"):
        shutil.copy(out / "rebinarized" / f"valid{suffix}", out / "label" / f"valid{suffix}")
    return out


def _train_classifier(data, save, *task_args):
    return ["fairseq-train", data, "--user-dir", USER_DIR, "--arch", "transformer_classifier", *CLASSIFIER,
            "--optimizer", "adam", "--lr", "0.003", "--batch-size", "16", "--max-update", "2", "--save-dir", save,
            "--cpu", "--num-workers", "0", *task_args]


TAGGING = ["--task", "sequence_tagging", "--criterion", "sequence_tagging"]


@pytest.mark.slow
def test_an_unknown_tag_in_valid_is_refused_before_training(tagging_data, tmp_path):
    data = with_bad_valid_label(tagging_data, tmp_path / "data", "B-LOC")
    line = refusal(*_train_classifier(data, tmp_path / "ckpt", *TAGGING))
    assert line == (f"ValueError: {data}/label/valid: line 1 has a label that is not in {data}/label/dict.txt (read "
                    "as <unk>): binarize every split's labels with one dictionary that holds them all "
                    "(fairseq-plugins-prepare-data does)")
    assert not list((tmp_path / "ckpt").glob("*.pt"))


@pytest.mark.slow
def test_an_unknown_label_in_valid_is_refused_before_training(sentence_data, tmp_path):
    data = with_bad_valid_label(sentence_data, tmp_path / "data", "neutral")
    line = refusal(*_train_classifier(data, tmp_path / "ckpt", *SENTENCE_ARGS))
    assert line.startswith(f"ValueError: {data}/label/valid: line 1 has a label that is not in "), line
    assert not list((tmp_path / "ckpt").glob("*.pt"))


@pytest.mark.slow
def test_more_labels_than_classes_is_refused_before_training(sentence_data, tmp_path):
    line = refusal(*_train_classifier(sentence_data, tmp_path / "ckpt", *SENTENCE_ARGS, "--num-classes", "1"))
    assert line == (f"ValueError: {sentence_data}/label/dict.txt has 2 labels (person, other) but --num-classes is "
                    "1: the last would be out of range of the head; set --num-classes 2")
    assert not list((tmp_path / "ckpt").glob("*.pt"))


@pytest.mark.slow
def test_an_empty_valid_split_is_named(tagging_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tagging_data, data)
    (data / "input0" / "valid.bin").write_bytes(b"")
    line = refusal(*_train_classifier(data, tmp_path / "ckpt", *TAGGING))
    assert line == f"ValueError: {data}/input0/valid.bin is empty: its split has no lines"


@pytest.mark.slow
def test_an_empty_translation_split_is_named(tiny_data_bin, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data_bin, data)
    (data / "valid.en-de.de.bin").write_bytes(b"")
    line = refusal("fairseq-train", *train_args(data, tmp_path / "ckpt", "bpt_transformer", max_update=2))
    assert line == f"ValueError: {data}/valid.en-de.de.bin is empty: its split has no lines"
    assert not list((tmp_path / "ckpt").glob("*.pt"))


@pytest.mark.slow
def test_graph_k_0_is_refused_in_one_line_before_the_model_is_built(enwik8_bin, tmp_path):
    line = sole_line(*_train_lm(enwik8_bin, tmp_path / "ckpt", "--graph-k", "0"))
    assert line == "fairseq-train: error: --graph-k must be an integer >= 1, got 0"


@pytest.mark.slow
def test_several_processes_without_a_gpu_are_told_to_add_cpu(tmp_path):
    """fairseq's own spawn counts GPUs: without --cpu there are none to start processes on. The
    refusal comes before the data is read (the folder here is empty)."""
    args = [arg for arg in train_args(tmp_path, tmp_path / "ckpt", "transformer") if arg != "--cpu"]
    line = sole_line("fairseq-train", *args, "--distributed-world-size", "2", env={"CUDA_VISIBLE_DEVICES": ""})
    assert line == ("fairseq-train: error: --distributed-world-size 2 starts one process per GPU, and this machine "
                    "has none: add --cpu to run the processes on CPU (gloo), or use a machine with GPUs")


@pytest.mark.slow
def test_a_regression_target_that_is_not_a_number_is_named(sentence_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(sentence_data / "input0", data / "input0")
    (data / "label").mkdir()
    for split in ("train", "valid"):
        lines = len((sentence_data.parent / "raw" / f"{split}.label").read_text().splitlines())
        (data / "label" / f"{split}.label").write_text("".join(f"{i % 5}.5\n" for i in range(lines)))
    (data / "label" / "valid.label").write_text("1.5\n2\nhigh\n")
    args = [*SENTENCE_ARGS, "--num-classes", "1", "--regression-target", "--best-checkpoint-metric", "loss"]
    line = refusal(*_train_classifier(data, tmp_path / "ckpt", *args))
    assert line == f"ValueError: {data}/label/valid.label:3: the regression target 'high' is not a number"
    assert not list((tmp_path / "ckpt").glob("*.pt"))
