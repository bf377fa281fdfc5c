"""TranSFormer Table 4d's sentencepiece slow branch: the WMT14 En-De data segmented by sentencepiece
instead of BPE (prepared from the raw-format WMT fixtures, no network), a TranSFormer trained on it
with fairseq-train, decoded with --remove-bpe sentencepiece and scored."""

import json
import subprocess
import sys

import pytest
from fairseq.data import Dictionary

from fairseq_plugins.recipes import evaluate
from fairseq_plugins.modules.slowfast.subword_characters import detect_subword_style
from fairseq_plugins.recipes.data.sentencepiece_segmentation import SENTENCEPIECE_WORD_START
from tests.cli import FIXTURES, REPO, generate, train
from tests.sacrebleu_fixture import sacrebleu_env

pytestmark = pytest.mark.cli  # spm_data_bin runs prepare-data in a process of its own

WMT = FIXTURES / "wmt"


@pytest.fixture(scope="module")
def spm_data_bin(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spm")
    out = tmp / "data"
    proc = subprocess.run([sys.executable, "-m", "fairseq_plugins.recipes.prepare_data", "wmt14-en-de-slowfast-spm",
                           "--raw-dir", str(WMT), "--out", str(out), "--workers", "1"],
                          cwd=REPO, env=sacrebleu_env(tmp), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_the_text_is_sentencepiece_pieces_of_the_tokenized_text(spm_data_bin):
    meta = json.loads((spm_data_bin / "prep.json").read_text())
    assert meta["bpe"] == "sentencepiece" and meta["bpe_merges"] == 32000
    assert (spm_data_bin / "spm.model").exists() and not (spm_data_bin / "bpe.codes").exists()
    lines = (spm_data_bin / "text" / "train.en").read_text(encoding="utf-8").splitlines()
    assert lines and all(line.split()[0].startswith(SENTENCEPIECE_WORD_START) for line in lines)
    assert not any("@@" in line for line in lines)
    joined = [evaluate.join_subwords(line, "sentencepiece") for line in lines]
    assert all(SENTENCEPIECE_WORD_START not in line and "  " not in line for line in joined)
    assert evaluate.remove_bpe_flags(spm_data_bin) == ["--remove-bpe", "sentencepiece"]
    # the fast branch finds the words of the pieces by their "▁" (the model's subword style auto)
    symbols = Dictionary.load(str(spm_data_bin / "dict.en.txt")).symbols
    assert detect_subword_style(symbols) == "sentencepiece"
    assert evaluate.remove_bpe_flags(spm_data_bin.parent / "not-prepared") == ["--remove-bpe"]


@pytest.mark.slow
def test_transformer_on_sentencepiece_trains_decodes_and_scores(spm_data_bin, tmp_path):
    log = train(spm_data_bin, tmp_path / "ckpt", "transformer_slowfast",
                ["--fast-embed-dim", "16", "--fast-attention-heads", "2", "--share-all-embeddings"],
                max_update=10).stdout
    assert "subword_style='auto'" in log
    out = generate(spm_data_bin, tmp_path / "ckpt" / "checkpoint_last.pt", evaluate.remove_bpe_flags(spm_data_bin))
    hyps = evaluate.read_hypotheses(out)
    assert hyps and not any(SENTENCEPIECE_WORD_START in h for h in hyps.values())
    scores = evaluate.score(out, spm_data_bin, "test", tmp_path / "scored")
    refs = (tmp_path / "scored" / "test.ref.tok.de").read_text(encoding="utf-8").splitlines()
    assert len(refs) == scores["sentences"] and not any(SENTENCEPIECE_WORD_START in r for r in refs)
