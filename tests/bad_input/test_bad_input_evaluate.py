"""fairseq-plugins-evaluate under bad input: no score is written that is not the test set's."""

import pytest

from fairseq_plugins.models.dictionary_fingerprint import DictionaryMismatchError
from fairseq_plugins.recipes import evaluate_classification
from fairseq_plugins.recipes.evaluate import evaluate
from tests.bad_input.test_bad_input_eval_lm import LONGER
from tests.bad_input.test_bad_input_hub import classifier, rebinarized_labels  # noqa: F401  (classifier: a fixture)


@pytest.mark.slow
def test_the_evaluation_writes_no_result_for_a_refused_context(enwik8_bin, tiny_lm, tmp_path):
    cfg = {"name": "lm/tiny_window_lm", "table": "t", "id": "tiny", "row": "r", "column": "c", "data": "enwik8",
           "arch": "window_lm", "task": {"task": "language_modeling"},
           "evaluate": {"tokens-per-sample": int(LONGER), "max-tokens": 1024}}
    with pytest.raises(RuntimeError, match="longer than the 64 positions window_lm was trained with"):
        evaluate(cfg, enwik8_bin, [tiny_lm("window_lm") / "checkpoint_last.pt"], "test", tmp_path / "results")
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_the_evaluation_refuses_labels_in_another_order(classifier, tmp_path):  # noqa: F811
    data, save = classifier
    swapped = rebinarized_labels(data, tmp_path / "swapped", lambda lines: [lines[1], lines[0], *lines[2:]])
    cfg = {"name": "classification/tiny", "table": "t", "row": "r", "column": "c", "data": "tiny"}
    with pytest.raises(DictionaryMismatchError, match="another label dictionary"):
        evaluate_classification.evaluate(cfg, swapped, [save / "checkpoint_best.pt"], "test", tmp_path / "results")
    assert not (tmp_path / "results").exists()
