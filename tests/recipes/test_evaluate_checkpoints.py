"""fairseq-plugins-evaluate scores exactly the checkpoints the user names: --checkpoint as given
(one, or several for a row with seeds), else the row's runs under --runs-dir by run key, never
other folders beside a checkpoint; a checkpoint of another model is refused before any scoring."""

from pathlib import Path

import pytest
import torch

from fairseq_plugins.recipes import evaluate
from fairseq_plugins.recipes.config import ConfigError, run_key, seed_configs
from tests.table_files import one_row_table

CLASSIFIER = dict(data="sst5-phrases", arch="bpt_classifier_sst5", gpus=1, average_last=0, seeds=3,
                  task={"task": "sentence_prediction", "num-classes": 5}, train={"lr": 0.001})


def _checkpoint(path: Path, arch: str, num_classes: int = 5) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"cfg": {"model": {"_name": arch}, "task": {"num_classes": num_classes}}, "model": {}}, path)
    return path


@pytest.fixture
def row(tmp_path):
    return evaluate.load_config(one_row_table(tmp_path / "t.yaml", metric="accuracy", **CLASSIFIER))


def test_given_checkpoints_are_used_as_given(row, tmp_path):
    given = [tmp_path / f"seed{i}.pt" for i in range(3)]
    assert evaluate.row_checkpoints(row, tmp_path / "runs", given) == given
    assert evaluate.row_checkpoints(row, tmp_path / "runs", given[:1]) == given[:1]  # a seeds row: X only
    translation = evaluate.load_config(one_row_table(
        tmp_path / "mt.yaml", data="wmt", arch="transformer", gpus=1, average_last=0, task={"task": "translation"}))
    with pytest.raises(ConfigError, match="scores one checkpoint, got --checkpoint 2 times"):
        evaluate.row_checkpoints(translation, tmp_path / "runs", given[:2])


def test_without_checkpoints_the_runs_are_found_by_their_keys(row, tmp_path):
    runs = tmp_path / "runs"
    found = evaluate.row_checkpoints(row, runs, [])
    assert found == [runs / run_key(run) / "checkpoint_best.pt" for run in seed_configs(row)]


def test_a_checkpoint_of_another_model_is_refused_before_scoring(row, tmp_path, monkeypatch):
    scored = []
    monkeypatch.setattr(evaluate.evaluate_classification, "evaluate", lambda *args: scored.append(args))
    other = [_checkpoint(tmp_path / f"ms{i}.pt", "ms_classifier_sst") for i in range(3)]
    with pytest.raises(ConfigError, match=r"ms0.pt is a ms_classifier_sst model; test-table:tiny scores bpt_class"):
        evaluate.evaluate(row, tmp_path, other, "test", tmp_path / "results")
    classes = [_checkpoint(tmp_path / f"c{i}.pt", "bpt_classifier_sst5", num_classes=3) for i in range(3)]
    with pytest.raises(ConfigError, match="trained with 3 classes; test-table:tiny has 5"):
        evaluate.evaluate(row, tmp_path, classes, "test", tmp_path / "results")
    assert not scored and not (tmp_path / "results").exists()
    good = [_checkpoint(tmp_path / f"g{i}.pt", "bpt_classifier_sst5") for i in range(3)]
    evaluate.evaluate(row, tmp_path, good, "test", tmp_path / "results")
    assert scored and scored[0][2] == good


def test_the_command_refuses_in_one_line(row, tmp_path):
    ref = f"{tmp_path / 't.yaml'}:tiny"
    with pytest.raises(SystemExit, match=r"^fairseq-plugins-evaluate: .*a.pt does not exist"):
        evaluate.main([ref, "--checkpoint", str(tmp_path / "a.pt")])
    with pytest.raises(SystemExit, match=r"does not exist: train first"):
        evaluate.main([ref, "--runs-dir", str(tmp_path / "runs")])


def test_no_bleu_over_an_empty_test_set(tmp_path):
    (tmp_path / "prep.json").write_text('{"target_lang": "de", "lowercase": false, "corpus": "x"}')
    (tmp_path / "test.raw.de").write_text("")
    with pytest.raises(ConfigError, match="test.raw.de holds no sentence"):
        evaluate.score("", tmp_path, "test", tmp_path / "out")
    assert not (tmp_path / "out").exists()
