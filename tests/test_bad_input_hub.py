"""The hub (``from_pretrained``) under bad input: a data folder whose labels were binarized in
another order is refused, never read as other classes."""

import shutil
from pathlib import Path

import pytest

from fairseq_plugins.models.dictionary_fingerprint import OVERRIDE, DictionaryMismatchError
from fairseq_plugins.models.transformer_classifier import TransformerClassifierModel
from tests.classification_data import write_classification
from tests.cli import USER_DIR, run_cli
from tests.test_classification import SENTENCE_ARGS, _train


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """(data-bin, save folder) of a transformer_classifier trained 4 updates."""
    data = write_classification(tmp_path_factory.mktemp("labels"))
    save = _train(data, tmp_path_factory.mktemp("classifier") / "ckpt", "--arch", "transformer_classifier",
                  *SENTENCE_ARGS, "--max-update", "4")
    return data, save


def rebinarized_labels(data: Path, out: Path, order) -> Path:
    """A copy of ``data`` whose label/ is binarized again with its dictionary's symbols in
    ``order(symbols)``."""
    shutil.copytree(data, out)
    lines = (data / "label" / "dict.txt").read_text().splitlines()
    (out / "order.txt").write_text("".join(line + "\n" for line in order(lines)))
    shutil.rmtree(out / "label")
    raw = data.parent / "raw"
    run_cli("fairseq-preprocess", "--only-source", "--srcdict", out / "order.txt", "--trainpref", raw / "train.label",
            "--validpref", raw / "valid.label", "--testpref", raw / "test.label", "--destdir", out / "label",
            "--workers", "1")
    return out


def _hub(save, data, **kwargs):
    return TransformerClassifierModel.from_pretrained(str(save), "checkpoint_best.pt", str(data),
                                                      user_dir=str(USER_DIR), **kwargs)


@pytest.mark.slow
def test_labels_in_another_order_are_refused(classifier, tmp_path):
    data, save = classifier
    # the two labels' frequency order turned around (madeupword padding stays last)
    swapped = rebinarized_labels(data, tmp_path / "swapped", lambda lines: [lines[1], lines[0], *lines[2:]])
    with pytest.raises(DictionaryMismatchError) as refused:
        _hub(save, swapped)
    assert str(refused.value).startswith("the checkpoint was trained with another label dictionary than the one "
                                         "loaded now (label: 9 symbols); labels would be swapped")
    assert f"{OVERRIDE}=1" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_labels_in_the_same_order_are_accepted(classifier, tmp_path):
    data, save = classifier
    same = rebinarized_labels(data, tmp_path / "same", lambda lines: lines)
    sentence = "a man is riding a bike ."
    assert _hub(save, same).predict_label(sentence) == _hub(save, data).predict_label(sentence)
