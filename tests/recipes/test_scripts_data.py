"""Data preparation on raw-format fixtures (no network): readers, recipes, binarization."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_plugins.recipes import prepare_data
from fairseq_plugins.recipes.data.common import keep_clean
from fairseq_plugins.recipes.data.download import Archive, locate
from fairseq_plugins.recipes.data.readers import read_mteval, read_ted_tags
from fairseq_plugins.recipes.data.text_processing import TextProcessor

from tests.sacrebleu_fixture import FIXTURE as SACREBLEU_FIXTURE, sacrebleu_env
from tests.cli import FIXTURES, REPO

WMT = FIXTURES / "wmt"


def _lines(path: Path):
    return path.read_text(encoding="utf-8").splitlines()


def test_read_mteval_sgm_keeps_documents():
    pairs = read_mteval(SACREBLEU_FIXTURE / "wmt14" / "full" / "raw" / "test-full" / "newstest2014-deen-src.en.sgm")
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


def test_chinese_is_segmented_into_words_with_jieba():
    assert TextProcessor("zh")("她用iPhone拍了照片。") == "她 用 iPhone 拍 了 照片 。"
    assert TextProcessor("zh")("他在2010年开始研究鱼类。") == "他 在 2010 年 开始 研究 鱼类 。"


def test_chinese_character_splitting_is_a_named_option_latin_words_kept():
    split = TextProcessor("zh", zh_segmentation="characters")
    assert split("她用iPhone拍了照片。") == "她 用 iPhone 拍 了 照 片 。"
    with pytest.raises(ValueError, match="unknown Chinese segmentation"):
        TextProcessor("zh", zh_segmentation="words")("照片")


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


def _prepare_in_process_of_its_own(tmp_path, *args):
    """The console command as a user runs it, away from the checkout, with the fixture sacrebleu
    cache (SACREBLEU)."""
    out = tmp_path / "out"
    subprocess.run([shutil.which("fairseq-plugins-prepare-data"), *args, "--out", str(out)],
                   check=True, cwd=tmp_path, env=sacrebleu_env(tmp_path), capture_output=True)
    return out, json.loads((out / "prep.json").read_text())


# corpus -> (valid, test) as sacrebleu names them, and their sizes in the fixture cache
WMT_SETS = {
    "wmt14-en-de-bpt": (("wmt13", 12), ("wmt14", 10)),  # test: the filtered newstest2014
    "wmt14-en-de-slowfast": (("wmt16", 12), ("wmt14/full", 12)),
    "wmt14-en-de-fairseq": (None, ("wmt14/full", 12)),
    "wmt16-en-ro": (("wmt16/dev", 6), ("wmt16", 6)),
    "wmt17-zh-en": (("wmt17/dev", 6), ("wmt17", 6)),
}


@pytest.mark.parametrize("corpus", sorted(WMT_SETS))
@pytest.mark.cli
def test_wmt_recipes_take_dev_and_test_sets_from_sacrebleu(tmp_path, corpus):
    small = ["--allow-less-training-data"] if corpus.startswith("wmt17-zh-en") else []  # the fixture's 36 pairs
    out, meta = _prepare_in_process_of_its_own(tmp_path, corpus, "--raw-dir", str(WMT), "--bpe-merges", "40",
                                               "--no-binarize", *small)
    src, tgt = meta["source_lang"], meta["target_lang"]
    for split, expected in zip(("valid", "test"), WMT_SETS[corpus]):
        if expected is None:
            assert "valid" not in meta["origins"]  # held out from training
            continue
        name, n = expected
        assert meta["origins"][split] == f"sacrebleu -t {name} -l {src}-{tgt}"
        assert meta["sentences"][split] == n
        # the references scored later are sacrebleu's text of the set, line for line
        cached = tmp_path / "sacrebleu" / name / f"{name.replace('/', '_')}.{src}-{tgt}.ref"
        if not meta["romanian_strip"]:
            assert _lines(out / f"{split}.raw.{tgt}") == _lines(cached)
        assert len(_lines(out / f"{split}.docids")) == n
    for split in ("train", "valid", "test"):
        assert len(_lines(out / "text" / f"{split}.{src}")) == len(_lines(out / f"{split}.raw.{tgt}"))
    assert any("@@" in line for line in _lines(out / "text" / f"train.{tgt}"))


@pytest.mark.parametrize("corpus,expected", [
    ("wmt17-zh-en", "这是 一个 关于 海洋 的 故事 。"),  # jieba words (then BPE)
    ("wmt17-zh-en-characters", "这 是 一 个 关 于 海 洋 的 故 事 。"),
])
@pytest.mark.cli
def test_chinese_source_is_segmented_before_bpe(tmp_path, corpus, expected):
    out, meta = _prepare_in_process_of_its_own(tmp_path, corpus, "--raw-dir", str(WMT), "--bpe-merges", "40",
                                               "--no-binarize", "--allow-less-training-data")
    assert meta["zh_segmentation"] == corpus.removeprefix("wmt17-zh-en-").replace("wmt17-zh-en", "jieba")
    assert _lines(out / "text" / "test.zh")[1].replace("@@ ", "") == expected


@pytest.mark.cli
def test_zh_en_on_news_commentary_alone_is_refused_with_its_pair_count(tmp_path):
    """TranSFormer trained Zh-En on about 18M pairs; News Commentary alone is about 1/80 of it."""
    args = [sys.executable, "-m", "fairseq_plugins.recipes.prepare_data", "wmt17-zh-en", "--raw-dir", str(WMT),
            "--bpe-merges", "40", "--no-binarize", "--out", str(tmp_path / "o")]
    env = sacrebleu_env(tmp_path)
    refused = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    assert refused.returncode == 1 and refused.stderr.startswith(
        "wmt17-zh-en: 36 training pairs (news-commentary-v12.zh-en), about 1/500000 of the 18,000,000 the paper")
    assert "--extra-parallel PREFIX" in refused.stderr and "--allow-less-training-data" in refused.stderr
    assert not (tmp_path / "o").exists()  # refused before writing anything
    subprocess.run(args + ["--allow-less-training-data"], cwd=REPO, env=env, check=True, capture_output=True)
    meta = json.loads((tmp_path / "o" / "prep.json").read_text())
    assert meta["paper_training_pairs"] == 18_000_000 and meta["sentences"]["train"] <= 36
    assert meta["training_corpora"] == ["news-commentary-v12.zh-en"]


def test_missing_sacrebleu_test_set_names_what_to_do(tmp_path):
    env = {**sacrebleu_env(tmp_path), "SACREBLEU": str(tmp_path / "empty"), "http_proxy": "http://127.0.0.1:9",
           "https_proxy": "http://127.0.0.1:9"}
    code = "from fairseq_plugins.recipes.data.sacrebleu_sets import sacrebleu_split; sacrebleu_split('wmt14', 'en-de')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "sacrebleu -t wmt14 -l en-de --echo src" in proc.stderr


def test_iwslt14_prepares_text_from_fixtures(tmp_path):
    out = prepare_data.main(["iwslt14-de-en", "--raw-dir", str(FIXTURES / "iwslt14"), "--out", str(tmp_path),
                             "--bpe-merges", "40", "--no-binarize"])
    meta = json.loads((out / "prep.json").read_text())
    for split in ("train", "valid", "test"):
        assert len(_lines(out / "text" / f"{split}.de")) == len(_lines(out / f"{split}.raw.en")) \
            == meta["sentences"][split] > 0
    assert all(line == line.lower() for line in _lines(out / "text" / "train.en"))


@pytest.mark.cli
def test_iwslt15_writes_talk_ids_aligned_with_sentences_and_binarizes(tmp_path):
    out = prepare_data.main(["iwslt15-zh-en", "--raw-dir", str(FIXTURES / "iwslt15"),
                             "--out", str(tmp_path), "--bpe-merges", "40", "--vocab-size", "40"])
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
    # separate dictionaries of at most --vocab-size symbols (4 specials included; the recipe: 30k),
    # words from jieba, and fairseq's binarized layout
    meta = json.loads((out / "prep.json").read_text())
    assert meta["vocab_size"] == 40 and meta["zh_segmentation"] == "jieba"
    assert prepare_data.CORPORA["iwslt15-zh-en"](FIXTURES / "iwslt15", tmp_path)[1].vocab_size == 30000
    for lang in ("zh", "en"):
        words = [w.split()[0] for w in _lines(out / f"dict.{lang}.txt") if not w.startswith("madeupword")]
        assert len(words) + 4 == 40
    assert (out / "test.zh-en.zh.bin").exists() and (out / "train.zh-en.en.idx").exists()


def test_mismatched_parallel_files_are_rejected(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in ("train", "val", "test_2016_flickr"):
        (raw / f"{name}.en").write_text("a b\nc d\n")
        (raw / f"{name}.de").write_text("x y\n")
    with pytest.raises(SystemExit, match="the train split: .*train.en has 2 lines but .*train.de has 1"):
        prepare_data.main(["multi30k-en-de", "--raw-dir", str(raw), "--out", str(tmp_path / "o"),
                           "--no-binarize"])
