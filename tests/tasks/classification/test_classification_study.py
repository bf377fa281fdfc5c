"""scripts/classification_study.py in its tiny mode: data from the committed captions, real training, a report."""

import pytest

from scripts import classification_study

pytestmark = pytest.mark.cli  # every test here runs a program of scripts/


@pytest.mark.slow
def test_tiny_study_trains_scores_and_reports(tmp_path):
    text = classification_study.main(["--tiny", "--models", "transformer_classifier,bpt_classifier", "--seeds", "1",
                                      "--out", str(tmp_path)])
    assert "| Transformer encoder (baseline) | " in text and "| BPT (k 2, root) | " in text
    assert (tmp_path / "classification_study.json").exists()
    row = next(line for line in text.splitlines() if line.startswith("| BPT"))
    accuracy = float(row.split("|")[2])
    assert 0.0 <= accuracy <= 100.0
    # a finished run is reused, not retrained
    assert classification_study.main(["--tiny", "--models", "bpt_classifier", "--seeds", "1",
                                      "--out", str(tmp_path)]).count("| BPT") == 1
