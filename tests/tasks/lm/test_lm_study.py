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


def test_both_models_have_the_same_sizes():
    args = lm_study.parser().parse_args(["--layers", "3", "--dim", "64", "--k", "8"])
    flags = lm_study.model_flags(args)
    assert list(flags) == ["transformer_lm", "bpt_lm k8"]
    assert flags["transformer_lm"][:2] == ["--arch", "transformer_lm_matched"]  # dims and pre-norm as bpt_lm's
    size = {f: v for f, v in zip(flags["transformer_lm"], flags["transformer_lm"][1:]) if f.startswith("--decoder")}
    bpt = dict(zip(flags["bpt_lm k8"], flags["bpt_lm k8"][1:]))
    assert all(bpt[f] == v for f, v in size.items())
    assert size["--decoder-layers"] == "3" and size["--decoder-ffn-embed-dim"] == "256" and bpt["--graph-k"] == "8"
