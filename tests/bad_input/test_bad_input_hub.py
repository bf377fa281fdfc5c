"""The hub (``from_pretrained``) under bad input: a data folder whose labels were binarized in
another order is refused, never read as other classes; a tagger predicts tags only."""

import shutil
from pathlib import Path

import pytest

from fairseq_plugins.models.dictionary_fingerprint import OVERRIDE, DictionaryMismatchError
from fairseq_plugins.models.transformer_classifier import TransformerClassifierModel
from tests.classification_data import write_classification, write_tagging
from tests.cli import USER_DIR, run_cli
from tests.tasks.classification.test_classification import SENTENCE_ARGS, TINY, _train


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


@pytest.fixture(scope="module")
def tagger(tmp_path_factory):
    """(data-bin, save folder) of an ms_tagger trained 2 updates."""
    tmp = tmp_path_factory.mktemp("tagger")
    data = write_tagging(tmp / "tags")
    run_cli("fairseq-train", data, "--user-dir", USER_DIR, "--arch", "ms_tagger", *TINY, "--task", "sequence_tagging",
            "--criterion", "sequence_tagging", "--optimizer", "adam", "--lr", "0.005", "--batch-size", "16",
            "--max-update", "2", "--save-dir", tmp / "ckpt", "--cpu", "--num-workers", "0")
    return data, tmp / "ckpt"


def _tagger_hub(save, data):
    from fairseq_plugins.models.ms_classifier import MultiScaleClassifierModel

    return MultiScaleClassifierModel.from_pretrained(str(save), "checkpoint_last.pt", str(data), user_dir=str(USER_DIR))


@pytest.mark.slow
def test_the_tagger_never_predicts_a_symbol_that_is_not_a_tag(tagger):
    """The tag dictionary is padded (madeupword0000, ...) and the head has a column for each: even
    a head that prefers the padding predicts tags only."""
    hub = _tagger_hub(tagger[1], tagger[0])
    hub.eval()
    tags = hub.task.label_dictionary
    padding = tags.index("madeupword0000") - tags.nspecial
    hub.model.classification_heads["tagging_head"].out_proj.bias.data[padding] = 1e4
    assert set(hub.predict_label("a young man is sitting on a bench .")) <= {"O", "B-PER", "I-PER"}


@pytest.mark.slow
def test_tags_in_another_order_are_refused(tagger, tmp_path):
    data, save = tagger
    swapped = rebinarized_labels(data, tmp_path / "swapped", lambda lines: [lines[1], lines[0], *lines[2:]])
    with pytest.raises(DictionaryMismatchError, match="^the checkpoint was trained with another label dictionary"):
        _tagger_hub(save, swapped)
