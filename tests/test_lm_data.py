"""fairseq-plugins-prepare-data for the language-modelling corpora, on the fixtures of tests/fixtures/lm."""

import zipfile
from pathlib import Path

import pytest

from fairseq_plugins.recipes import prepare_data
from fairseq_plugins.recipes.data import language_modeling

LM = Path(__file__).resolve().parent / "fixtures" / "lm"


def tokens(path: Path):
    return [line.split() for line in path.read_text(encoding="utf-8").splitlines()]


def prepare(tmp_path, corpus, *extra):
    return prepare_data.main([corpus, "--raw-dir", str(LM / corpus), "--out", str(tmp_path / corpus), *extra])


def test_enwik8_bytes_round_trip(tmp_path):
    """Every byte is one token, a newline is a line end (fairseq's </s>), splits 90/5/5 as prep_enwik8."""
    out = prepare(tmp_path, "enwik8", "--heldout-chars", "3000")
    data = (LM / "enwik8" / "enwik8").read_bytes()
    parts = {"train": data[:-6000], "valid": data[-6000:-3000], "test": data[-3000:]}
    for split, part in parts.items():
        lines = tokens(out / "text" / f"{split}.txt")
        rebuilt = b"\n".join(bytes(int(t) for t in line) for line in lines)
        assert rebuilt in (part, part[:-1])  # a split ending in a newline: its last line's </s>
        symbols = sum(len(line) + 1 for line in lines)  # + fairseq's </s> per line
        assert symbols == len(part) + (not part.endswith(b"\n"))
    assert (out / "dict.txt").exists() and (out / "test.bin").exists() and (out / "train.idx").exists()
    assert any(int(line.split()[0]) > 127 for line in (out / "dict.txt").read_text().splitlines())  # UTF-8 bytes


def test_text8_characters_round_trip(tmp_path):
    out = prepare(tmp_path, "text8", "--heldout-chars", "2000", "--no-binarize")
    text = (LM / "text8" / "text8").read_text()
    for split, part in language_modeling.split_heldout(text, 2000).items():
        lines = tokens(out / "text" / f"{split}.txt")
        assert " ".join("".join(line).replace("_", " ") for line in lines) == part
    assert not (out / "dict.txt").exists()


def test_text8_lines_cut_at_spaces():
    text = "ab cd ef gh"
    assert list(language_modeling.character_lines(text, line_chars=3)) == ["a b _ c d", "e f _ g h"]
    assert list(language_modeling.character_lines(text, line_chars=100)) == [" ".join(text.replace(" ", "_"))]


@pytest.mark.parametrize("corpus,files", [("ptb", "ptb.{}.txt"), ("wikitext-2", "wiki.{}.tokens")])
def test_word_corpora_as_they_are(tmp_path, corpus, files):
    out = prepare(tmp_path, corpus)
    for split in ("train", "valid", "test"):
        assert (out / "text" / f"{split}.txt").read_text() == (LM / corpus / files.format(split)).read_text()
        assert (out / f"{split}.bin").exists()
    assert "<unk>" not in [line.split()[0] for line in (out / "dict.txt").read_text().splitlines()]  # fairseq's own


def test_downloaded_archive_with_the_wrong_checksum_is_refused(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    with zipfile.ZipFile(cache / "enwik8.zip", "w") as zf:
        zf.write(LM / "enwik8" / "enwik8", "enwik8")
    with pytest.raises(ValueError, match="sha256"):
        prepare_data.main(["enwik8", "--cache-dir", str(cache), "--out", str(tmp_path / "o")])


def test_translation_options_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="bpe-merges"):
        prepare(tmp_path, "ptb", "--bpe-merges", "10")


def test_too_little_text_for_the_heldout_splits(tmp_path):
    with pytest.raises(ValueError, match="cannot hold out"):
        prepare(tmp_path, "text8")  # 5M characters each: the fixture is 20k
