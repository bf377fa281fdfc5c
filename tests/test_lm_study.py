"""The character-level LM study's corpus and bookkeeping (its fairseq runs: tests/test_demo.py)."""

import pytest

from fairseq_plugins.recipes import lm_study


def test_corpus_is_english_prose_from_the_running_python():
    text = lm_study.python_docs_text()
    assert len(text) > 300_000 and text.endswith("\n")
    assert "The \"assert\" statement" in text and text.count(" the ") > 2_000


def test_codepoint_lines_keep_every_character_once():
    text = "Tab\there, _under_ and é\n\nlast line\n"
    lines = list(lm_study.codepoint_lines(text))
    assert len(lines) == 3 and lines[1] == ""  # the blank line is one </s>
    decoded = "\n".join("".join(chr(int(t)) for t in line.split()) for line in lines) + "\n"
    assert decoded == text
    assert all(" " not in token for line in lines for token in line.split(" "))
    assert len(list(lm_study.codepoint_lines("no newline at the end"))) == 1


def test_round_targets_split_the_updates():
    assert lm_study.round_targets(120, 3) == [40, 80, 120]
    assert lm_study.round_targets(5, 2) == [2, 5]  # round() to even: 2.5 -> 2
    with pytest.raises(ValueError, match="cannot be split"):
        lm_study.round_targets(2, 3)


def test_both_models_have_the_same_sizes():
    args = lm_study.parser().parse_args(["--layers", "3", "--dim", "64", "--k", "8"])
    flags = lm_study.model_flags(args)
    assert list(flags) == ["transformer_lm", "bpt_lm k8"]
    size = {f: v for f, v in zip(flags["transformer_lm"], flags["transformer_lm"][1:]) if f.startswith("--decoder")}
    bpt = dict(zip(flags["bpt_lm k8"], flags["bpt_lm k8"][1:]))
    assert all(bpt[f] == v for f, v in size.items())
    assert size["--decoder-layers"] == "3" and size["--decoder-ffn-embed-dim"] == "256" and bpt["--graph-k"] == "8"
