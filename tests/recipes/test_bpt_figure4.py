"""BPT Figure 4 (Sec 4.1: "we tried different k in {1, 2, 4, 8, 16, 32, 64}") as a table: its dry run
trains BPT on SST-5 and on IMDB at every k, each with the level clip and lr decay of the original's
config for that k (yzh119/BPT@3ce980d configs/sst5-K.yml, imdb-K.yml), over Table 1's settings; one
row trains and scores for real at a tiny size (no other test runs a BPT classifier row end to end)."""

import json
import re

import pytest
import torch

from fairseq_plugins.recipes import evaluate, reproduce_table, train
from fairseq_plugins.recipes.config import load_table, run_key, seed_configs
from tests.classification_data import write_classification
from tests.cli import FIXTURES

KS = (1, 2, 4, 8, 16, 32, 64)
# k -> (graph_attrs clip_dist, opt_attrs rate) of the original's configs/sst5-K.yml: sst5-1.yml names no rate
# (ExponentialDecay's default 0.97); no sst5-32.yml or sst5-64.yml: sst5-16.yml's values, the largest k it has
SST5 = {1: (3, "0.97"), 2: (2, "0.98"), 4: (1, "0.99"), 8: (1, "0.99"), 16: (1, "1"), 32: (1, "1"), 64: (1, "1")}
IMDB_CLIP = {1: 7, 2: 6, 4: 5, 8: 4, 16: 3, 32: 2, 64: 1}  # clip_dist of configs/imdb-K.yml (opt_wrapper steady)


def _flag(command: str, flag: str):
    match = re.search(rf" {flag} (\S+)", command)
    return match and match.group(1)


def test_dry_run_trains_each_k_on_both_datasets_with_the_originals_settings(capsys, tmp_path):
    reproduce_table.main(["bpt-figure4", "--dry-run", "--data-root", str(tmp_path / "data-bin"),
                          "--runs-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("bpt-figure4: 14 rows, 140 training runs")
    trained, row = {}, None  # (dataset, k) -> the fairseq-train commands of its row
    for line in lines:
        header = re.match(r"\[\d+/140\] \S+: bpt-figure4:bpt-(sst5|imdb)-k(\d+)$", line)
        if header:
            row = (header.group(1), int(header.group(2)))
        elif re.match(r"\s+\S*fairseq-train ", line):
            trained.setdefault(row, []).append(line + " ")
    assert sorted(trained) == sorted((data, k) for data in ("imdb", "sst5") for k in KS)
    for (data, k), commands in trained.items():
        assert len(commands) == 10, "10 runs a point, as Table 1's"
        for command in commands:
            assert _flag(command, "--graph-k") == str(k)
            if data == "sst5":
                clip, rate = SST5[k]
                assert _flag(command, "--arch") == "bpt_classifier" and _flag(command, "--lr-shrink") == rate
                assert _flag(command, "--force-anneal") == "2" and "data-bin/sst5-phrases-lowercase " in command
            else:
                clip = IMDB_CLIP[k]
                assert _flag(command, "--arch") == "bpt_classifier_imdb" and "data-bin/imdb-lowercase " in command
                assert "--lr-shrink" not in command and "--force-anneal" not in command
            assert _flag(command, "--graph-rel-clip") == str(clip)


def test_the_figure_reports_no_numbers_and_its_table_1_points_are_table_1s_runs():
    figure, table1 = load_table("bpt-figure4")["configs"], load_table("bpt-table1")["configs"]
    assert all(cfg["reported"] == {} for cfg in figure)
    assert all("as a plot only" in cfg["note"] for cfg in figure)
    by_id = {cfg["id"]: cfg for cfg in figure + table1}
    for point, row in (("bpt-sst5-k2", "bpt-sst5"), ("bpt-imdb-k4", "bpt-imdb")):
        assert [run_key(r) for r in seed_configs(by_id[point])] == [run_key(r) for r in seed_configs(by_id[row])]
    assert by_id["bpt-sst5-k64"]["sources"]["model.graph-rel-clip"].startswith("ours: no original SST-5 config")


@pytest.mark.cli
@pytest.mark.slow
def test_a_row_trains_at_its_k_and_is_scored(tmp_path, capsys):
    """bpt-figure4:bpt-imdb-k8 (2 classes, as the tiny corpus) through fairseq-plugins-train and -evaluate,
    its sizes shrunk by flags after ``--`` (GloVe's tiny 8-d fixture for the 300-d vectors)."""
    data = write_classification(tmp_path / "sentences")
    tiny = ["--encoder-layers", "1", "--encoder-embed-dim", "8", "--encoder-ffn-embed-dim", "16",
            "--encoder-attention-heads", "2", "--encoder-embed-path", str(FIXTURES / "glove" / "tiny.8d.txt"),
            "--max-update", "4", "--batch-size", "16", "--num-workers", "0", "--log-format", "simple"]
    row = "bpt-figure4:bpt-imdb-k8"
    save = train.main([row, "--data", str(data), "--runs-dir", str(tmp_path / "runs"), "--world-size", "0",
                       "--seed", "1", "--", *tiny])
    command = capsys.readouterr().out
    assert " --graph-k 8 --graph-rel-clip 4 " in command and " --arch bpt_classifier_imdb " in command
    model = torch.load(save / "checkpoint_best.pt", weights_only=False)["cfg"]["model"]
    assert (model.graph_k, model.graph_rel_clip, model.encoder_layers) == (8, 4, 1)
    result = evaluate.main([row, "--data", str(data), "--checkpoint", str(save / "checkpoint_best.pt"),
                            "--results-dir", str(tmp_path / "results")])
    assert 0.0 <= result["accuracy"] <= 100.0 and result["column"] == "IMDB" and result["row"] == "BPT (k = 8)"
    saved = json.loads((tmp_path / "results" / "bpt-figure4" / "bpt-imdb-k8.json").read_text())
    assert saved["accuracy"] == result["accuracy"]
