"""The character-level LM study's corpus and bookkeeping (its fairseq runs: tests/recipes/test_demo.py)."""

import json

import pytest
import torch

from fairseq_plugins.data import character_tokens
from fairseq_plugins.recipes import lm_study
from fairseq_plugins.recipes.data import language_modeling


def test_corpus_is_english_prose_from_the_running_python():
    text = lm_study.python_docs_text()
    assert len(text) > 300_000 and text.endswith("\n")
    assert "The \"assert\" statement" in text and text.count(" the ") > 2_000


def test_corpus_is_one_document_with_its_newlines(tmp_path):
    """One token per character, newlines included, one </s> at the text's end; a data-bin of the
    earlier format (the newline as </s>) is prepared again rather than reused."""
    from fairseq.data import Dictionary, data_utils

    out = tmp_path / "data-bin"
    out.mkdir()
    (out / "prep.json").write_text(json.dumps({"heldout": 5000, "unit": "characters"}))
    lm_study.prepare_corpus(out, 5000)
    meta = json.loads((out / "prep.json").read_text())
    assert meta["format"] == language_modeling.FORMAT and meta["symbols"]["test"] == 5000
    dictionary = Dictionary.load(str(out / "dict.txt"))
    test = data_utils.load_indexed_dataset(str(out / "test"), dictionary)
    tokens = [dictionary[i] for i in torch.cat([test[i] for i in range(len(test))]).tolist()]
    assert tokens[-1] == "</s>" and tokens.count("</s>") == 1 and tokens.count("10") > 50
    known = {line.split()[0] for line in (out / "dict.txt").read_text().splitlines()}
    expected = [t if t in known else "<unk>" for t in character_tokens.encode(lm_study.python_docs_text()[-5000:],
                                                                           "characters").split()]
    assert tokens[:-1] == expected


def test_round_targets_split_the_updates():
    assert lm_study.round_targets(120, 3) == [40, 80, 120]
    assert lm_study.round_targets(5, 2) == [2, 5]  # round() to even: 2.5 -> 2
    with pytest.raises(ValueError, match="cannot be split"):
        lm_study.round_targets(2, 3)


def test_every_model_has_the_baseline_sizes():
    args = lm_study.parser().parse_args(["--layers", "3", "--dim", "64", "--k", "8", "--window", "32"])
    flags = lm_study.model_flags(args)
    assert list(flags) == ["transformer_lm", "bpt_lm k8", "segtree_lm", "window_lm w32", "sparse_lm s128"]
    assert flags["transformer_lm"][:2] == ["--arch", "transformer_lm_matched"]  # dims and pre-norm as the others'
    size = {f: v for f, v in zip(flags["transformer_lm"], flags["transformer_lm"][1:]) if f.startswith("--decoder")}
    assert size["--decoder-layers"] == "3" and size["--decoder-ffn-embed-dim"] == "256"
    for name, model in flags.items():
        given = dict(zip(model, model[1:]))
        assert all(given[f] == v for f, v in size.items()), name
    assert dict(zip(flags["bpt_lm k8"], flags["bpt_lm k8"][1:]))["--graph-k"] == "8"
    assert dict(zip(flags["window_lm w32"], flags["window_lm w32"][1:]))["--attention-window"] == "32"


def test_models_are_chosen_and_the_baseline_always_runs_first():
    args = lm_study.parser().parse_args(["--models", "sparse_lm,bpt_lm"])
    assert list(lm_study.model_flags(args)) == ["transformer_lm", "bpt_lm k4", "sparse_lm s128"]
    assert lm_study.parser().parse_args(["--seeds", "4,5"]).seeds == [4, 5]
    with pytest.raises(SystemExit):
        lm_study.parser().parse_args(["--seeds", "1,two"])
    with pytest.raises(ValueError, match="unknown lstm_lm"):
        lm_study.model_flags(lm_study.parser().parse_args(["--models", "bpt_lm,lstm_lm"]))


def test_equal_time_is_the_last_checkpoint_within_the_transformers_time():
    assert lm_study.equal_time_updates(120, 1.0, 10, 3.0) == 120  # the baseline: its own updates
    assert lm_study.equal_time_updates(125, 1.0, 10, 3.0) == 125  # checkpoint_last, not the kept 120
    assert lm_study.equal_time_updates(120, 0.58, 10, 3.0) == 60  # 69.6 updates: the checkpoint at 60
    assert lm_study.equal_time_updates(120, 1.5, 10, 3.0) == 180  # faster: trains on to 180
    assert lm_study.equal_time_updates(120, 9.0, 10, 3.0) == 360  # at most 3x
    assert lm_study.equal_time_updates(120, 0.05, 10, 3.0) == 0  # 6 updates: before the first checkpoint


def _seed(seed, bpc, time_bpc, time_updates, ratios):
    rounds = [{"params": 100, "tokens_per_second": 1000.0 * r, "load": 1.0} for r in ratios]
    return {"seed": seed, "rounds": rounds, "speed_vs_baseline_per_round": ratios,
            "equal_updates": {"bpc": bpc, "test_tokens": 11, "eval_tokens_per_second": 5.0},
            "equal_time": {"updates": time_updates, "bpc": time_bpc}}


def test_a_row_is_the_mean_and_sample_sd_over_seeds():
    row = lm_study.summarise("bpt_lm k4", [_seed(1, 2.0, 2.5, 60, [0.5, 0.7]), _seed(2, 3.0, 3.5, 70, [0.6, 0.6]),
                                           _seed(3, 4.0, 4.5, 60, [0.4, 0.8])], 120)
    assert row["bpc"] == pytest.approx(3.0) and row["bpc_sd"] == pytest.approx(1.0)  # sample sd, not population
    assert row["equal_time"] == {"updates": [60, 70, 60], "bpc": {"mean": pytest.approx(3.5), "sd": pytest.approx(1.0)}}
    assert row["speed_vs_baseline_per_round"] == [0.5, 0.7, 0.6, 0.6, 0.4, 0.8]
    assert row["speed_vs_baseline"] == pytest.approx(0.6) and row["seeds"] == [1, 2, 3]
    missing = lm_study.summarise("x", [_seed(1, 2.0, None, 0, [0.1]), _seed(2, 3.0, 3.5, 10, [0.2])], 120)
    assert missing["equal_time"]["bpc"] == {"mean": None, "sd": None} and missing["bpc"] == pytest.approx(2.5)
    result = {"settings": {**vars(lm_study.parser().parse_args([])), "checkpoint_interval": 10},
              "corpus": {"corpus": "c", "python": "3", "sha256": "0" * 64,
                         "symbols": {"train": 1, "valid": 1, "test": 1}},
              "load": {"mean": 1.0, "max": 2.0}, "cores": 2, "seconds": 60.0, "rows": [row, missing]}
    table = lm_study.markdown(result)
    assert "| bpt_lm k4 | 100 | 3.000 ± 1.000 | 60, 70, 60 | 3.500 ± 1.000 |" in table
    assert "| x | 100 | 2.500 ± 0.707 | 0, 10 | n/a ± n/a |" in table
