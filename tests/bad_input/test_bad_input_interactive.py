"""fairseq-interactive under bad input: a line with nothing to translate, or longer than the
model takes, is skipped with a one-line error naming it, and the session goes on to the next
line; the lines translated keep their numbers."""

import pytest

from tests.cli import USER_DIR, hypotheses, run_cli, train
from tests.document_fixture import binarized_doc_fixture

DOC_ARGS = ["--task", "document_translation", "--context-tokens", "32"]
LONG = " ".join(["a"] * 8)  # 9 tokens with </s>: over --max-source-positions 8


def _interactive(data, checkpoint, lines, *extra):
    return run_cli("fairseq-interactive", data, "--user-dir", USER_DIR, "--path", checkpoint, "--source-lang", "en",
                   "--target-lang", "de", "--beam", "2", "--cpu", "--max-source-positions", "8", *extra,
                   input="".join(line + "\n" for line in lines))


def _errors(proc):
    return [line.split(" | ")[-1] for line in proc.stderr.splitlines() if " | ERROR | " in line]


@pytest.mark.slow
def test_the_translation_task_skips_an_empty_and_an_over_long_line(tiny_data_bin, tmp_path):
    """The stock task; a buffer of several lines, so that the kept lines' ids are remapped."""
    train(tiny_data_bin, tmp_path / "ckpt", "transformer", max_update=2)
    lines = ["a man is walking .", "", LONG, "a dog runs ."]
    proc = _interactive(tiny_data_bin, tmp_path / "ckpt" / "checkpoint_last.pt", lines, "--buffer-size", "4",
                        "--batch-size", "4")
    assert _errors(proc) == [
        "input line 2 (id 1) is empty: nothing to translate; skipped",
        "input line 3 (id 2) has 9 tokens with </s>, more than the 8 source positions allowed; skipped",
    ]
    assert sorted(hypotheses(proc.stdout)) == [0, 3]
    assert "S-0\ta man is walking ." in proc.stdout and "S-3\ta dog runs ." in proc.stdout


@pytest.mark.slow
def test_the_document_task_skips_a_line_without_a_sentence(tmp_path):
    data = binarized_doc_fixture(tmp_path)
    train(data, tmp_path / "ckpt", "transformer", DOC_ARGS, max_update=2)
    lines = ["", "<s>", "a dog runs . <s>", f"a dog . <s> {LONG}", "a man is walking ."]
    proc = _interactive(data, tmp_path / "ckpt" / "checkpoint_last.pt", lines, *DOC_ARGS)
    assert _errors(proc) == [
        "input line 1 (id 0) is empty: nothing to translate; skipped",
        "input line 4 (id 3) has 13 tokens with </s>, more than the 8 source positions allowed; skipped",
    ]
    skipped = [line for line in proc.stderr.splitlines() if "skipped an input line" in line]
    assert [line.split(": ", 1)[-1] for line in skipped] == ["'<s>'", "'a dog runs . <s>'"]
    assert len(hypotheses(proc.stdout)) == 1  # the last line, translated after the four skipped
    assert "S-4\ta man is walking ." in proc.stdout  # one line at a time: it keeps its number
