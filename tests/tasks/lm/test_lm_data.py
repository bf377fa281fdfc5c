"""fairseq-plugins-prepare-data for the language-modelling corpora, on the fixtures of tests/fixtures/lm,
and for a user's own text (``text``)."""

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch

from fairseq_plugins.data import character_tokens
from fairseq_plugins.recipes import evaluate_lm, prepare_data
from fairseq_plugins.recipes.data import language_modeling
from tests.cli import FIXTURES

LM = FIXTURES / "lm"


def prepare(tmp_path, corpus, *extra, raw=None):
    return prepare_data.main([corpus, "--raw-dir", str(raw or LM / corpus), "--out", str(tmp_path / corpus), *extra])


def split_tokens(out: Path, split: str):
    """The binarized split as fairseq's language_modeling reads it: its token strings, in order."""
    from fairseq.data import Dictionary, data_utils

    dictionary = Dictionary.load(str(out / "dict.txt"))
    dataset = data_utils.load_indexed_dataset(str(out / split), dictionary)
    return [dictionary[i] for i in torch.cat([dataset[i] for i in range(len(dataset))]).tolist()]


def check_splits(out: Path, parts, unit: str, ended=("test",)):
    """Every symbol of each part is one token, in order, the newline among them (a symbol not in
    train's dictionary is <unk>); ``</s>`` only at the end of the splits in ``ended`` (where the
    corpus ends)."""
    known = {line.split()[0] for line in (out / "dict.txt").read_text().splitlines()}
    assert "10" in known  # the newline is a symbol of its own
    for split, part in parts.items():
        tokens = split_tokens(out, split)
        eos = [i for i, t in enumerate(tokens) if t == "</s>"]
        assert eos == ([len(tokens) - 1] if split in ended else [])
        expected = [t if t in known else "<unk>" for t in character_tokens.encode(part, unit).split()]
        assert [t for t in tokens if t != "</s>"] == expected


def test_enwik8_bytes_round_trip(tmp_path):
    """Every byte is one token, the newline byte too; </s> only at the corpus's end; splits 90/5/5 as prep_enwik8."""
    out = prepare(tmp_path, "enwik8", "--heldout-chars", "3000")
    data = (LM / "enwik8" / "enwik8").read_bytes()
    assert b"\n" in data[-3000:]
    parts = {"train": data[:-6000], "valid": data[-6000:-3000], "test": data[-3000:]}
    check_splits(out, parts, "bytes")
    meta = json.loads((out / "prep.json").read_text())
    assert meta["format"] == language_modeling.FORMAT and meta["unit"] == "bytes"
    assert meta["symbols"] == {s: len(p) for s, p in parts.items()}
    assert meta["documents_ended"] == {"train": 0, "valid": 0, "test": 1}
    assert any(int(line.split()[0]) > 127 for line in (out / "dict.txt").read_text().splitlines())  # UTF-8 bytes


def test_text8_characters_round_trip(tmp_path):
    out = prepare(tmp_path, "text8", "--heldout-chars", "2000")
    text = (LM / "text8" / "text8").read_text()
    parts = {"train": text[:-4000], "valid": text[-4000:-2000], "test": text[-2000:]}
    for split, part in parts.items():
        tokens = [t for t in split_tokens(out, split) if t != "</s>"]
        assert character_tokens.decode(" ".join(tokens), "characters") == part
    assert "32" in (out / "dict.txt").read_text().split()  # the space, as its code point


def test_character_corpora_have_no_preprocess_step(tmp_path):
    with pytest.raises(SystemExit, match="--no-binarize does not apply"):
        prepare(tmp_path, "text8", "--heldout-chars", "2000", "--no-binarize")


@pytest.mark.parametrize("unit", character_tokens.UNITS)
def test_tokens_round_trip(unit):
    text = "Tab\there, _under_, é and 🙂\n\nlast line\n"
    tokens = character_tokens.encode(text, unit)
    assert character_tokens.decode(tokens, unit) == text
    assert tokens.split()[-1] == "10" and " " not in "".join(tokens.split())
    assert character_tokens.decode(tokens + " <unk> 65", unit) == text + "\ufffdA"


def test_an_incomplete_utf8_byte_sequence_decodes_to_a_replacement():
    assert character_tokens.decode("195 169 195", "bytes") == "é\ufffd"


@pytest.mark.cli
@pytest.mark.parametrize("corpus,files", [("ptb", "ptb.{}.txt"), ("wikitext-2", "wiki.{}.tokens")])
def test_word_corpora_as_they_are(tmp_path, corpus, files):
    out = prepare(tmp_path, corpus)
    for split in ("train", "valid", "test"):
        assert (out / "text" / f"{split}.txt").read_text() == (LM / corpus / files.format(split)).read_text()
        assert (out / f"{split}.bin").exists()
    assert "<unk>" not in [line.split()[0] for line in (out / "dict.txt").read_text().splitlines()]  # fairseq's own
    language_modeling.check_format(out)  # words: one </s> per line is their convention, in every format


@pytest.mark.cli
def test_wikitext2_lowercased_as_segtree_reads_it(tmp_path):
    """--lowercase and the wikitext-2-lowercase corpus: the cased files lowercased, one dictionary
    entry per lowercased word, recorded in prep.json; character corpora refuse it."""
    raw = LM / "wikitext-2"
    flag = prepare(tmp_path / "flag", "wikitext-2", "--lowercase", raw=raw)
    named = prepare(tmp_path / "named", "wikitext-2-lowercase", raw=raw)
    cased = prepare(tmp_path / "cased", "wikitext-2", raw=raw)
    for out in (flag, named):
        for split in ("train", "valid", "test"):
            assert (out / "text" / f"{split}.txt").read_text() == (raw / f"wiki.{split}.tokens").read_text().lower()
        assert json.loads((out / "prep.json").read_text())["lowercase"] is True
    assert json.loads((cased / "prep.json").read_text())["lowercase"] is False
    words = {out: {line.split()[0] for line in (out / "dict.txt").read_text().splitlines()
                   if not line.startswith("madeupword")} for out in (flag, cased)}  # fairseq's padding entries
    assert words[flag] == {w.lower() for w in words[cased]} and words[flag] != words[cased]
    with pytest.raises(SystemExit, match="--lowercase applies to the word corpora"):
        prepare(tmp_path, "enwik8", "--lowercase")


def test_downloaded_archive_with_the_wrong_checksum_is_refused(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    with zipfile.ZipFile(cache / "enwik8.zip", "w") as zf:
        zf.write(LM / "enwik8" / "enwik8", "enwik8")
    with pytest.raises(SystemExit, match="sha256"):
        prepare_data.main(["enwik8", "--cache-dir", str(cache), "--out", str(tmp_path / "o")])


def test_translation_options_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="bpe-merges"):
        prepare(tmp_path, "ptb", "--bpe-merges", "10")


def test_too_little_text_for_the_heldout_splits(tmp_path):
    with pytest.raises(SystemExit, match="cannot hold out 2 x 5,000,000.*--heldout-chars"):
        prepare(tmp_path, "text8")  # 5M characters each: the fixture is 20k


def test_an_earlier_character_data_bin_is_refused_with_the_reason(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "prep.json").write_text(json.dumps({"corpus": "enwik8", "unit": "bytes", "metric": "bpc"}))
    with pytest.raises(ValueError, match="newline as </s>.*prepare it again"):
        language_modeling.check_format(old)
    cfg = {"name": "lm/x", "data": "enwik8", "evaluate": {}, "task": {}}
    with pytest.raises(ValueError, match="newline as </s>"):  # fairseq-plugins-evaluate, before fairseq-eval-lm
        evaluate_lm.evaluate(cfg, old, old / "checkpoint_best.pt", "test", tmp_path / "results")
    from fairseq_plugins.recipes import reproduce_table, train

    with pytest.raises(SystemExit, match="^fairseq-plugins-train: .*newline as </s>"):  # before fairseq-train
        train.main(["bpt-table3:enwik8", "--data", str(old), "--world-size", "0"])
    assert not reproduce_table._prepared(old)  # the reproduce command prepares it again
    (old / "prep.json").write_text(json.dumps({"format": language_modeling.FORMAT, "unit": "bytes"}))
    language_modeling.check_format(old)
    assert reproduce_table._prepared(old)


TEXT = "First line\nsecond line, é\n\nA third.\n" * 40  # 1,440 characters, 1,480 UTF-8 bytes


def test_text_file_as_characters(tmp_path):
    source = tmp_path / "my text.txt"
    source.write_text(TEXT, encoding="utf-8")
    out = prepare(tmp_path, "text", "--heldout-chars", "100", raw=source)
    check_splits(out, {"train": TEXT[:-200], "valid": TEXT[-200:-100], "test": TEXT[-100:]}, "characters")
    meta = json.loads((out / "prep.json").read_text())
    assert meta["corpus"] == "text" and meta["unit"] == "characters" and meta["heldout"] == 100
    assert meta["sources"] == [{"file": str(source.resolve()), "bytes": len(TEXT.encode()),
                                "sha256": hashlib.sha256(TEXT.encode()).hexdigest()}]


def test_text_folder_as_bytes_one_document_per_file(tmp_path):
    """Files in sorted order, each ending with </s>; held-out sizes by default 1/20 of the text each."""
    folder = tmp_path / "texts"
    (folder / "b").mkdir(parents=True)
    (folder / "b" / "two.txt").write_text("second\n" * 100)
    (folder / "a.txt").write_text(TEXT)
    (folder / ".hidden").write_text("not read")
    out = prepare(tmp_path, "text", "--unit", "bytes", raw=folder)
    meta = json.loads((out / "prep.json").read_text())
    assert [Path(s["file"]).name for s in meta["sources"]] == ["a.txt", "two.txt"]
    total = len(TEXT.encode()) + 700
    assert meta["heldout"] == total // 20 and sum(meta["symbols"].values()) == total
    tokens = [t for split in ("train", "valid", "test") for t in split_tokens(out, split)]
    first = len(TEXT.encode())
    assert [i for i, t in enumerate(tokens) if t == "</s>"] == [first, len(tokens) - 1]
    assert character_tokens.decode(" ".join(tokens[:first]), "bytes") == TEXT


@pytest.mark.parametrize("content,extra,message", [
    (None, [], "does not exist"),
    (b"", [], "no text"),
    ("folder", [], "holds no files"),
    (b"abc\n", ["--heldout-chars", "2"], "4 symbols cannot hold out 2 x 2"),
    (b"caf\xe9\n", [], "not UTF-8.*--unit bytes"),
])  # fmt: skip
def test_bad_text_gets_a_one_line_error(tmp_path, content, extra, message):
    source = tmp_path / "source"
    if content == "folder":
        source.mkdir()
    elif content is not None:
        source.write_bytes(content)
    with pytest.raises(SystemExit, match=message) as err:
        prepare(tmp_path, "text", *extra, raw=source)
    assert "\n" not in str(err.value)


def test_unit_is_for_text_only(tmp_path):
    with pytest.raises(SystemExit, match="--unit applies to text only"):
        prepare(tmp_path, "enwik8", "--unit", "bytes")
