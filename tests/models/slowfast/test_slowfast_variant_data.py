"""TranSFormer's WMT14 En-De variants (Table 7's low-resource samples, Figure 5b's BPE sizes, Table 4d's
sentencepiece data in test_slowfast_sentencepiece_data.py) on the
raw-format WMT fixtures, through sacrebleu's fixture cache (no network)."""

import hashlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from fairseq_plugins.recipes.data import wmt
from fairseq_plugins.recipes.data.download import locate
from fairseq_plugins.recipes.data.wmt_slowfast_variants import CORPORA
from tests.cli import FIXTURES, REPO
from tests.sacrebleu_fixture import sacrebleu_env

WMT = FIXTURES / "wmt"

# one process per recipe: sacrebleu reads SACREBLEU when it is imported
_PREPARE_SAMPLE = """
import dataclasses, sys
from pathlib import Path
from fairseq_plugins.recipes.data.common import prepare
from fairseq_plugins.recipes.data.wmt_slowfast_variants import low_resource
splits, recipe = low_resource(int(sys.argv[1]))(Path(sys.argv[2]), Path(sys.argv[3]) / "cache")
prepare("sample", splits, dataclasses.replace(recipe, bpe_merges=40), Path(sys.argv[3]) / "out", binarize=False)
"""


def _lines(path: Path):
    return path.read_text(encoding="utf-8").splitlines()


def _prepare_sample(tmp_path: Path, env, pairs: int, name: str):
    out_root = tmp_path / name
    subprocess.run([sys.executable, "-c", _PREPARE_SAMPLE, str(pairs), str(WMT), str(out_root)], cwd=REPO,
                   env=env, check=True, capture_output=True)
    out = out_root / "out"
    return out, json.loads((out / "prep.json").read_text())


def test_the_corpora_are_the_papers_sizes():
    assert sorted(CORPORA) == sorted(
        [f"wmt14-en-de-slowfast-{n}" for n in ("50k", "500k", "1000k")]
        + [f"wmt14-en-de-slowfast-bpe{k}k" for k in (10, 20, 30, 40, 50)]
        + ["wmt14-en-de-slowfast-spm"]
    )


def test_a_low_resource_sample_is_seeded_in_corpus_order_and_recorded(tmp_path):
    env = sacrebleu_env(tmp_path)
    out, meta = _prepare_sample(tmp_path, env, 25, "a")
    src, tgt = _lines(out / "train.raw.en"), _lines(out / "train.raw.de")
    assert meta["sentences"]["train"] == len(src) == len(tgt) == 25
    assert meta["train_sample"] == 25 and meta["train_sample_seed"] == 1
    digest = hashlib.sha256("".join(f"{s}\t{t}\n" for s, t in zip(src, tgt)).encode("utf-8")).hexdigest()
    assert meta["train_sample_sha256"] == digest
    corpus = [(s, t) for prefix in ("europarl-v7", "commoncrawl", "news-commentary-v9")
              for s, t in zip(_lines(WMT / f"{prefix}.de-en.en"), _lines(WMT / f"{prefix}.de-en.de"))]
    positions = [corpus.index(pair) for pair in zip(src, tgt)]
    assert positions == sorted(positions) and positions != list(range(25))  # a random draw, in corpus order
    assert meta["origins"] == {"valid": "sacrebleu -t wmt16 -l en-de", "test": "sacrebleu -t wmt14/full -l en-de"}
    _, again_meta = _prepare_sample(tmp_path, env, 25, "b")
    assert again_meta["train_sample_sha256"] == digest  # the same pairs on every machine


@pytest.mark.cli
def test_a_sample_larger_than_the_corpus_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fairseq_plugins.recipes.prepare_data", "wmt14-en-de-slowfast-50k",
                           "--raw-dir", str(WMT), "--no-binarize", "--out", str(tmp_path / "o")],
                          cwd=REPO, env=sacrebleu_env(tmp_path), capture_output=True, text=True)
    assert proc.returncode != 0
    assert "a training sample of 50,000 pairs was asked for, but only" in proc.stderr
    assert "are the raw files complete?" in proc.stderr


@pytest.mark.cli
def test_bpe_sizes_change_only_the_merges(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fairseq_plugins.recipes.prepare_data", "wmt14-en-de-slowfast-bpe10k",
                           "--raw-dir", str(WMT), "--no-binarize", "--out", str(tmp_path / "o")],
                          cwd=REPO, env=sacrebleu_env(tmp_path), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((tmp_path / "o" / "prep.json").read_text())
    assert meta["bpe_merges"] == 10_000 and meta["joint_bpe"] and "train_sample" not in meta
    assert meta["origins"] == {"valid": "sacrebleu -t wmt16 -l en-de", "test": "sacrebleu -t wmt14/full -l en-de"}


def test_wmt14_archives_are_checked_against_their_published_sha256(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (tmp_path / "news-commentary-v9.de-en.en").write_text("not the real corpus\n")
    with tarfile.open(raw / "training-parallel-nc-v9.tgz", "w:gz") as tar:
        tar.add(tmp_path / "news-commentary-v9.de-en.en", arcname="training/news-commentary-v9.de-en.en")
    assert all(len(arc.sha256) == 64 for arc in (wmt.EUROPARL_V7, wmt.COMMONCRAWL, wmt.NEWS_COMMENTARY_V9))
    with pytest.raises(ValueError, match="is not the published cb8953f2.*delete it and run again"):
        locate([wmt.NEWS_COMMENTARY_V9], raw, tmp_path / "cache")
