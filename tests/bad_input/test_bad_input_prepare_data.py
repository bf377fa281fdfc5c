"""fairseq-plugins-prepare-data under bad raw data: one line naming the file or split, exit
non-zero, nothing written."""

import gzip
import shutil
from pathlib import Path

import pytest

from fairseq_plugins.recipes import prepare_data
from fairseq_plugins.recipes.data import download
from fairseq_plugins.recipes.data.readers import BadRawData
from tests.cli import FIXTURES, MULTI30K

MTL16 = FIXTURES / "classification" / "mtl16"


def refused(*argv) -> str:
    with pytest.raises(SystemExit) as stop:
        prepare_data.main([str(a) for a in argv])
    message = str(stop.value.code)
    assert "\n" not in message
    return message


def _multi30k(tmp_path) -> Path:
    raw = tmp_path / "raw"
    shutil.copytree(MULTI30K, raw)
    return raw


def test_a_truncated_gz_is_named(tmp_path):
    raw = _multi30k(tmp_path)
    damaged = raw / "val.de.gz"
    damaged.write_bytes(damaged.read_bytes()[:-20])
    message = refused("multi30k-en-de", "--raw-dir", raw, "--out", tmp_path / "out")
    assert message.startswith(f"{damaged} is truncated or damaged (EOFError: ") and message.endswith(
        "; delete it and download or copy it again")
    assert not (tmp_path / "out").exists()


def test_a_truncated_archive_is_named_and_not_left_unpacked(tmp_path):
    raw, cache = tmp_path / "raw", tmp_path / "cache"
    raw.mkdir()
    packed = raw / "enwik8.zip"
    shutil.make_archive(str(packed.with_suffix("")), "zip", FIXTURES / "lm" / "enwik8")
    packed.write_bytes(packed.read_bytes()[:-40])  # the zip's directory at its end is cut off
    # enwik8's archive without its pinned sha256 (a cut file fails that check first): the unpacking is tested
    archive = download.Archive("http://example.invalid/enwik8.zip", ["enwik8"])
    with pytest.raises(BadRawData) as err:
        download.locate([archive], raw, cache)
    assert str(err.value).startswith(f"{packed} is truncated or damaged (BadZipFile: ")
    assert not (cache / "enwik8.zip.d").exists()


def test_line_counts_that_differ_name_the_split_and_both_counts(tmp_path):
    raw = _multi30k(tmp_path)
    with gzip.open(raw / "val.de.gz", "rt", encoding="utf-8") as f:
        lines = f.readlines()
    with gzip.open(raw / "val.de.gz", "wt", encoding="utf-8") as f:
        f.writelines(lines[:-1])
    message = refused("multi30k-en-de", "--raw-dir", raw, "--out", tmp_path / "out")
    assert message == (f"the valid split: {raw / 'val.en.gz'} has {len(lines):,} lines but {raw / 'val.de.gz'} has "
                       f"{len(lines) - 1:,}; the two sides must be aligned line by line")
    assert not (tmp_path / "out").exists()


def _mtl16(tmp_path, test_lines: str) -> Path:
    raw = tmp_path / "raw"
    shutil.copytree(MTL16, raw)
    (raw / "apparel.task.test").write_text(test_lines, encoding="utf-8")
    return raw


@pytest.mark.slow  # fairseq-preprocess
@pytest.mark.cli
def test_a_label_only_in_test_gets_a_class_not_unk(tmp_path):
    """fairseq-preprocess builds the label dictionary from train alone: the test's extra label
    would be <unk>, a target of -1."""
    from fairseq.data import Dictionary, data_utils

    raw = _mtl16(tmp_path, "1\tgreat shirt\n2\ta label nobody trained\n")
    out = prepare_data.main(["mtl16-apparel", "--raw-dir", str(raw), "--out", str(tmp_path / "out")])
    labels = Dictionary.load(str(out / "label" / "dict.txt"))
    test = data_utils.load_indexed_dataset(str(out / "label" / "test"), labels)
    assert [labels.string(test[i][:-1]) for i in range(len(test))] == ["1", "2"]
    assert labels.symbols[labels.nspecial:labels.nspecial + 3] == ["0", "1", "2"]  # train's order, then the rest


def test_an_empty_split_is_refused(tmp_path):
    raw = _mtl16(tmp_path, "")
    assert refused("mtl16-apparel", "--raw-dir", raw, "--out", tmp_path / "out") == \
        "mtl16-apparel: the test split is empty"
    assert not (tmp_path / "out").exists()


def test_an_empty_translation_split_is_refused(tmp_path):
    """fairseq-preprocess would write an empty valid.bin that training cannot open."""
    raw = _multi30k(tmp_path)
    for lang in ("en", "de"):
        with gzip.open(raw / f"val.{lang}.gz", "wt", encoding="utf-8"):
            pass
    assert refused("multi30k-en-de", "--raw-dir", raw, "--out", tmp_path / "out") == \
        "multi30k-en-de: the valid split is empty"
    assert not (tmp_path / "out").exists()
