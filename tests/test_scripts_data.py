"""Data preparation on raw-format fixtures (no network): readers, recipes, binarization."""

import json
from pathlib import Path

import pytest

from scripts import prepare_data
from scripts.data.common import (TextProcessor, keep_clean, locate, read_mteval, read_ted_tags,
                                 Archive)

FIXTURES = Path(__file__).parent / "fixtures"
WMT = FIXTURES / "wmt"


def _lines(path: Path):
    return path.read_text(encoding="utf-8").splitlines()


def test_read_mteval_sgm_keeps_documents():
    pairs = read_mteval(WMT / "newstest2014-deen-src.en.sgm")
    assert len(pairs) == 12
    assert [d for d, _ in pairs[:5]] == ["newstest2014-doc0"] * 4 + ["newstest2014-doc1"]
    assert all("<" not in s and s == s.strip() for _, s in pairs)


def test_read_ted_tags_drops_metadata_and_tracks_talks():
    path = FIXTURES / "iwslt15" / "zh-en" / "train.tags.zh-en.en"
    pairs = read_ted_tags(path)
    assert len(pairs) == 24 and {d for d, _ in pairs} == {"21", "22", "23"}
    assert not any(s.startswith("<") or s in ("Title", "Description") for _, s in pairs)
    with_titles = read_ted_tags(path, keep_tags=("title", "description"))
    assert len(with_titles) == 24 + 2 * 3 and with_titles[0] == ("21", "Title")


def test_read_ted_tags_rejects_text_outside_a_talk(tmp_path):
    bad = tmp_path / "train.tags.x-y.x"
    bad.write_text("hello\n<url>u</url>\n<talkid>1</talkid>\nworld\n", encoding="utf-8")
    with pytest.raises(ValueError, match="before the first"):
        read_ted_tags(bad)


def test_chinese_is_split_into_characters_latin_words_kept():
    assert TextProcessor("zh")("她用iPhone拍了照片。") == "她 用 iPhone 拍 了 照 片 。"


def test_romanian_diacritics_normalised_and_stripped():
    out = TextProcessor("ro", romanian_strip=True)("Cetăţenii şi Ședința, România")
    assert out == "Cetatenii si Sedinta , Romania"


def test_keep_clean_applies_length_and_ratio_limits():
    src = ["a b", "a", "", "a b c d"]
    tgt = ["x y", "x y z w", "x", "x y z"]
    assert keep_clean(src, tgt, max_len=3, ratio=1.5) == [0]


def test_locate_reports_every_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.en.*\n.*nope.de"):
        locate([Archive("http://example.invalid/x.tgz", ["nope.en", "nope.de"])], tmp_path, tmp_path)


def test_locate_unpacks_an_archive_found_in_raw_dir(tmp_path):
    import tarfile

    raw = tmp_path / "raw"
    raw.mkdir()
    (tmp_path / "corpus.en").write_text("hello\n")
    with tarfile.open(raw / "x.tgz", "w:gz") as tar:
        tar.add(tmp_path / "corpus.en", arcname="training/corpus.en")
    found = locate([Archive("http://example.invalid/x.tgz", ["corpus.en"])], raw, tmp_path / "cache")
    assert found["corpus.en"].read_text() == "hello\n"


@pytest.mark.parametrize("corpus,raw", [
    ("wmt14-en-de-bpt", WMT), ("wmt14-en-de-fairseq", WMT), ("wmt16-en-ro", WMT),
    ("wmt17-zh-en", WMT), ("iwslt14-de-en", FIXTURES / "iwslt14"),
])
def test_every_recipe_prepares_text_from_fixtures(tmp_path, corpus, raw):
    out = prepare_data.main([corpus, "--raw-dir", str(raw), "--out", str(tmp_path),
                             "--bpe-merges", "40", "--no-binarize"])
    meta = json.loads((out / "prep.json").read_text())
    src, tgt = meta["source_lang"], meta["target_lang"]
    for split in ("train", "valid", "test"):
        bpe_src, bpe_tgt = _lines(out / "text" / f"{split}.{src}"), _lines(out / "text" / f"{split}.{tgt}")
        raw_tgt = _lines(out / f"{split}.raw.{tgt}")
        assert len(bpe_src) == len(bpe_tgt) == len(raw_tgt) == meta["sentences"][split] > 0
    assert any("@@" in line for line in _lines(out / "text" / f"train.{tgt}"))
    if meta["lowercase"]:
        assert all(line == line.lower() for line in _lines(out / "text" / f"train.{tgt}"))


def test_iwslt15_writes_talk_ids_aligned_with_sentences_and_binarizes(tmp_path):
    out = prepare_data.main(["iwslt15-zh-en", "--raw-dir", str(FIXTURES / "iwslt15"),
                             "--out", str(tmp_path), "--bpe-merges", "40"])
    for split in ("train", "valid", "test"):
        docids = _lines(out / f"{split}.docids")
        assert len(docids) == len(_lines(out / f"{split}.raw.en")) == len(_lines(out / "text" / f"{split}.zh"))
    train_ids = _lines(out / "train.docids")
    assert train_ids == sorted(train_ids) and set(train_ids) == {"21", "22", "23"}
    # sentences stay in talk order: the first English line of talk 22 is the 9th training line
    tags_en = read_ted_tags(FIXTURES / "iwslt15" / "zh-en" / "train.tags.zh-en.en")
    assert _lines(out / "train.raw.en")[8] == tags_en[8][1] and train_ids[8] == "22"
    test_ids = _lines(out / "test.docids")
    assert test_ids[0] == "TED.tst2010.601" and len(set(test_ids)) == 8
    # separate dictionaries and fairseq's binarized layout
    assert (out / "dict.zh.txt").exists() and (out / "dict.en.txt").exists()
    assert (out / "test.zh-en.zh.bin").exists() and (out / "train.zh-en.en.idx").exists()


def test_mismatched_parallel_files_are_rejected(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in ("train", "val", "test_2016_flickr"):
        (raw / f"{name}.en").write_text("a b\nc d\n")
        (raw / f"{name}.de").write_text("x y\n")
    with pytest.raises(ValueError, match="2 source vs 1 target"):
        prepare_data.main(["multi30k-en-de", "--raw-dir", str(raw), "--out", str(tmp_path / "o"),
                           "--no-binarize"])
