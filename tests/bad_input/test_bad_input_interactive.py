"""fairseq-interactive under bad input: a line with nothing to translate is skipped with a
warning, and the session goes on to the next line."""

import pytest

from tests.cli import USER_DIR, hypotheses, run_cli, train
from tests.document_fixture import binarized_doc_fixture

DOC_ARGS = ["--task", "document_translation", "--context-tokens", "32"]


@pytest.mark.slow
def test_the_document_task_skips_a_line_without_a_sentence(tmp_path):
    data = binarized_doc_fixture(tmp_path)
    train(data, tmp_path / "ckpt", "transformer", DOC_ARGS, max_update=2)
    lines = ["", "<s>", "a dog runs . <s>", "a man is walking ."]
    checkpoint = tmp_path / "ckpt" / "checkpoint_last.pt"
    proc = run_cli("fairseq-interactive", data, "--user-dir", USER_DIR, "--path", checkpoint, "--source-lang", "en",
                   "--target-lang", "de", "--beam", "2", "--cpu", *DOC_ARGS,
                   input="".join(line + "\n" for line in lines))
    skipped = [line for line in proc.stderr.splitlines() if "skipped an input line" in line]
    assert [line.split(": ", 1)[-1] for line in skipped] == ["''", "'<s>'", "'a dog runs . <s>'"]
    assert len(hypotheses(proc.stdout)) == 1  # the last line, translated after the three skipped
    assert "S-3\ta man is walking ." in proc.stdout  # one line at a time: it keeps its number
