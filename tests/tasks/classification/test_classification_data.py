"""The classification and tagging corpora: readers on raw-format fixtures, prepare-data end to end,
and the licence messages of the corpora that cannot be downloaded."""

import json
from pathlib import Path

import pytest

from fairseq_plugins.recipes import prepare_data
from fairseq_plugins.recipes.data.classification import (
    CORPORA, parse_ptb_tree, read_conll, read_imdb, read_labelled_lines, read_snli, read_sst,
)
from tests import cli

FIXTURES = cli.FIXTURES / "classification"


def test_sst_trees_sentences_and_phrases():
    phrases = parse_ptb_tree("(3 (2 The) (4 (3 (2 film) (3 works)) (2 .)))")
    assert phrases[0] == ("3", ["The", "film", "works", "."])  # the whole sentence first
    assert sorted(phrases[1:]) == sorted([("2", ["The"]), ("2", ["film"]), ("3", ["works"]), ("3", ["film", "works"]),
                                          ("2", ["."]), ("4", ["film", "works", "."])])
    sentences = read_sst(FIXTURES / "sst" / "trees" / "train.txt", phrases=False)
    assert [(e.text, e.label) for e in sentences] == [("The film works .", "3"),
                                                      ("It never quite takes off .", "1"), ("( A triumph )", "4")]
    every = read_sst(FIXTURES / "sst" / "trees" / "train.txt", phrases=True)
    assert len(every) == 7 + 11 + 7  # one per node of each tree
    with pytest.raises(ValueError, match="unbalanced"):
        parse_ptb_tree("(3 (2 The) (2 film)")


def test_imdb_snli_mtl16_conll_readers():
    train = read_imdb(FIXTURES / "aclImdb", "train")
    assert len(train) == 10 and {e.label for e in train} == {"pos", "neg"}
    assert "<br />" not in " ".join(e.text for e in train)
    snli = read_snli(FIXTURES / "snli" / "snli_1.0" / "snli_1.0_train.jsonl")
    assert [e.label for e in snli] == ["entailment", "contradiction", "neutral"]  # the '-' pair is left out
    assert snli[0].text2 == "A person makes music ."
    mtl = read_labelled_lines(FIXTURES / "mtl16" / "apparel.task.train")
    assert len(mtl) == 203 and mtl[0].label == "0"  # the byte-order mark is not part of the label
    conll = read_conll(FIXTURES / "conll03" / "eng.train")
    assert [e.text for e in conll] == ["Acme Widgets hires Dutch engineers .", "Maria Lopez visited Oslo"]
    assert conll[0].label == "I-ORG I-ORG O I-MISC O O"


def _prepare(corpus, tmp_path, raw):
    return prepare_data.main([corpus, "--out", str(tmp_path / corpus), "--raw-dir", str(raw)])


@pytest.mark.cli
def test_prepare_sst_phrases(tmp_path):
    out = _prepare("sst5-phrases", tmp_path, FIXTURES / "sst")
    meta = json.loads((out / "prep.json").read_text())
    assert meta["examples"] == {"train": 25, "valid": 2, "test": 2} and meta["num_classes"] == 5
    assert (out / "input0" / "train.bin").exists() and (out / "label" / "dict.txt").exists()
    assert (out / "text" / "test.input0").read_text().splitlines() == ["Simply wonderful", "Too slow"]


@pytest.mark.cli
def test_prepare_snli_pairs_share_one_dictionary(tmp_path):
    out = _prepare("snli", tmp_path, FIXTURES / "snli")
    assert json.loads((out / "prep.json").read_text())["pairs"]
    assert (out / "input1" / "dict.txt").read_text() == (out / "input0" / "dict.txt").read_text()
    assert (out / "text" / "train.label").read_text().split() == ["entailment", "contradiction", "neutral"]


@pytest.mark.cli
def test_prepare_tagging_and_imdb(tmp_path):
    out = _prepare("conll03-ner", tmp_path, FIXTURES / "conll03")
    words = (out / "text" / "train.input0").read_text().splitlines()
    tags = (out / "text" / "train.label").read_text().splitlines()
    assert [len(w.split()) for w in words] == [len(t.split()) for t in tags]
    imdb = _prepare("imdb", tmp_path, FIXTURES / "aclImdb")
    assert json.loads((imdb / "prep.json").read_text())["examples"] == {"train": 9, "valid": 1, "test": 2}
    mtl = _prepare("mtl16-apparel", tmp_path, FIXTURES / "mtl16")
    assert json.loads((mtl / "prep.json").read_text())["examples"] == {"train": 3, "valid": 200, "test": 2}


@pytest.mark.parametrize("corpus, names", [("ptb-pos", "Linguistic Data Consortium"),
                                           ("conll03-ner", "Reuters"), ("conll12-ner", "OntoNotes"),
                                           ("mtl16-books", "MTL-16")])
def test_corpora_that_cannot_be_downloaded_say_where_to_get_them(corpus, names, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        prepare_data.main([corpus, "--out", str(tmp_path / "out"), "--raw-dir", str(tmp_path)])
    assert names in str(err.value) and "--raw-dir" in str(err.value)


def test_every_classification_config_names_a_corpus():
    from fairseq_plugins.recipes.config import all_configs

    tasks = ("sentence_prediction", "sequence_tagging")
    for cfg in all_configs():
        if cfg["task"].get("task") in tasks:
            assert cfg["data"] in CORPORA, cfg["name"]


def _sst_archive(folder: Path) -> Path:
    """A zip laid out as trainDevTestTrees_PTB.zip (trees/*.txt) from the SST fixture: not the published bytes."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / "trainDevTestTrees_PTB.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in ("train.txt", "dev.txt", "test.txt"):
            zf.write(FIXTURES / "sst" / "trees" / name, f"trees/{name}")
    return archive


def test_public_downloads_pin_a_sha256():
    from fairseq_plugins.recipes.data import classification

    for archive in (classification.SST, classification.IMDB, classification.SNLI):
        assert archive.url.startswith("https://") and len(archive.sha256) == 64
        int(archive.sha256, 16)


@pytest.mark.parametrize("given", ["raw-dir", "cache"])
def test_a_download_with_another_checksum_is_refused(given, tmp_path):
    archive = _sst_archive(tmp_path / "in")
    # the raw-dir case unpacks into a cache too: a private one, never the user's (which may hold SST unpacked)
    where = (["--raw-dir", str(tmp_path / "in"), "--cache-dir", str(tmp_path / "cache")] if given == "raw-dir"
             else ["--cache-dir", str(tmp_path / "in")])
    with pytest.raises(SystemExit) as err:
        prepare_data.main(["sst5", "--out", str(tmp_path / "out"), *where])
    message = str(err.value)
    assert str(archive) in message and "is not the published 5c613a4f" in message and "delete it" in message
    assert "HuggingFace" in message and not (tmp_path / "in" / "trainDevTestTrees_PTB.zip.d").exists()  # not unpacked


@pytest.mark.cli
def test_a_download_with_the_pinned_checksum_is_unpacked(tmp_path, monkeypatch):
    import dataclasses

    from fairseq_plugins.recipes.data import classification
    from fairseq_plugins.recipes.data.download import sha256_of

    archive = _sst_archive(tmp_path / "cache")
    monkeypatch.setattr(classification, "SST", dataclasses.replace(classification.SST, sha256=sha256_of(archive)))
    out = prepare_data.main(["sst5", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")])
    assert json.loads((out / "prep.json").read_text())["examples"] == {"train": 3, "valid": 2, "test": 2}


@pytest.mark.cli
def test_lowercase_preparations_are_their_own(tmp_path):
    """The originals' lowercasing: words lowercased after tokenization, labels kept, recorded in
    prep.json; the lowercased corpus is a name of its own, with another dictionary than the cased one."""
    cased = _prepare("sst5-phrases", tmp_path, FIXTURES / "sst")
    lowered = _prepare("sst5-phrases-lowercase", tmp_path, FIXTURES / "sst")
    asked = prepare_data.main(["sst5-phrases", "--lowercase", "--out", str(tmp_path / "asked"),
                               "--raw-dir", str(FIXTURES / "sst")])
    cased_text = (cased / "text" / "train.input0").read_text()
    assert cased_text.startswith("The film works .")
    for out in (lowered, asked):
        assert (out / "text" / "train.input0").read_text() == cased_text.lower()
        assert (out / "text" / "train.label").read_text() == (cased / "text" / "train.label").read_text()
        assert json.loads((out / "prep.json").read_text())["lowercase"] is True
    assert json.loads((cased / "prep.json").read_text())["lowercase"] is False
    assert json.loads((lowered / "prep.json").read_text())["corpus"] == "sst5-phrases-lowercase"
    cased_words = {line.split()[0] for line in (cased / "input0" / "dict.txt").read_text().splitlines()}
    lower_words = {line.split()[0] for line in (lowered / "input0" / "dict.txt").read_text().splitlines()}
    assert "The" in cased_words and "The" not in lower_words and lower_words == {w.lower() for w in cased_words}
    imdb = _prepare("imdb-lowercase", tmp_path, FIXTURES / "aclImdb")
    text = (imdb / "text" / "train.input0").read_text()
    assert text == text.lower() and text.strip()
    with pytest.raises(SystemExit, match="--lowercase"):
        prepare_data.main(["enwik8", "--lowercase", "--out", str(tmp_path / "lm")])
    with pytest.raises(SystemExit, match="--lowercase is for classification and word-level LM corpora"):
        prepare_data.main(["multi30k-en-de", "--lowercase", "--out", str(tmp_path / "mt")])
