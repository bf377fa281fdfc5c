"""scripts/classification_study.py in its tiny mode: data from the committed captions, real training, a report."""

import json

import pytest

from scripts import classification_study

pytestmark = pytest.mark.cli  # every test here runs a program of scripts/


def test_majority_rate_is_the_most_frequent_labels_share(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "test.label").write_text("person\nother\nperson\nperson\n")
    assert classification_study.majority_rate(tmp_path) == 75.0


@pytest.mark.slow
def test_tiny_study_chooses_the_lr_on_valid_trains_scores_and_reports(tmp_path):
    text = classification_study.main(["--tiny", "--models", "transformer_classifier,bpt_classifier", "--seeds", "1",
                                      "--select-lr", "0.001,0.01", "--out", str(tmp_path)])
    assert "| Transformer encoder (baseline) | " in text and "| BPT (k 2, root) | " in text
    saved = json.loads((tmp_path / "classification_study.json").read_text())
    selection = {float(lr): acc for lr, acc in saved["lr_selection_valid"].items()}
    assert set(selection) == {0.001, 0.01} and saved["lr"] == max(selection, key=selection.get)
    assert f"lr {saved['lr']:g} after 40 warm-up updates" in text and "--select-lr 0.001,0.01" in text
    majority = classification_study.majority_rate(tmp_path / "data")
    assert saved["majority_class_test"] == majority and f"| majority class | {majority:.2f} |" in text
    row = next(line for line in text.splitlines() if line.startswith("| BPT"))
    accuracy = float(row.split("|")[2])
    assert 0.0 <= accuracy <= 100.0
    assert saved["test_accuracy"]["bpt_classifier"]["1"] == pytest.approx(accuracy, abs=0.005)
    # a finished run is reused, not retrained
    assert classification_study.main(["--tiny", "--models", "bpt_classifier", "--seeds", "1", "--lr", str(saved["lr"]),
                                      "--out", str(tmp_path)]).count("| BPT") == 1
