"""Tables 5 and 6 of the BPT paper (document-level IWSLT15 Zh-En) through the reproduction
scripts, on the raw-format IWSLT15 fixture (tests/fixtures/iwslt15: two TED talks per set)."""

import json
import re

import pytest

pytest.importorskip("fairseq")
from fairseq_plugins.recipes import evaluate, prepare_data, reproduce_table, train  # noqa: E402
from fairseq_plugins.recipes.config import load_config  # noqa: E402

from tests.cli import FIXTURES, TINY_MODEL_ARGS  # noqa: E402

IWSLT15_RAW = FIXTURES / "iwslt15"


@pytest.mark.parametrize("table", ["bpt-table5", "bpt-table6"])
def test_every_row_trains_and_translates_with_its_context_length(table, tmp_path, capsys):
    reproduce_table.main([table, "--dry-run", "--gpus", "0", "--data-root", str(tmp_path),
                          "--runs-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "res")])
    commands = [line for line in capsys.readouterr().out.splitlines() if "fairseq-train" in line]
    assert commands
    for command in commands:
        context = re.search(r"--context-tokens (\d+)", command)
        if "--task document_translation" not in command:  # Table 5's sentence-level rows
            assert table == "bpt-table5" and context is None
            continue
        assert context is not None and int(context.group(1)) in (0, 32, 64, 128)
        # the original's chunk samples, with its 64/32/16 of them per batch (l = 0: the paper's 128)
        assert "--document-samples chunks" in command
        batch = {0: 128, 32: 64, 64: 32, 128: 16}[int(context.group(1))]
        assert re.search(r"--batch-size (\d+)", command).group(1) == str(batch)
    if table == "bpt-table5":  # "BPT (k = 4, l = 64)" is the one document-level row, run at l = 32
        assert [c for c in commands if "--task document_translation" in c] == [
            c for c in commands if "--context-tokens 32" in c and "--arch bpt_document" in c]
        assert len([c for c in commands if "--task document_translation" in c]) == 1
    if table == "bpt-table6":
        columns = sorted(int(re.search(r"--context-tokens (\d+)", c).group(1)) for c in commands)
        # full and aligned cross-attention transformers are one model at l = 0: one run
        assert columns == [0] * 3 + [32] * 4 + [64] * 4 + [128] * 4


@pytest.mark.cli
@pytest.mark.slow
def test_document_level_row_end_to_end_on_the_fixture(tmp_path):
    data = tmp_path / "data" / "iwslt15-zh-en"
    prepare_data.main(["iwslt15-zh-en", "--raw-dir", str(IWSLT15_RAW), "--out", str(data), "--workers", "1"])
    test_docids = (data / "test.docids").read_text().splitlines()
    assert len(set(test_docids)) > 1  # several talks: context must stop at their boundaries
    config = "bpt-table6:transformer-l32"
    tiny = [*TINY_MODEL_ARGS, "--max-epoch", "2", "--no-progress-bar", "--num-workers", "0"]
    run_dir = train.main([config, "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
                          "--world-size", "0", "--", *tiny])
    result = evaluate.main([config, "--data", str(data), "--checkpoint", str(run_dir / "checkpoint_last.pt"),
                            "--results-dir", str(tmp_path / "results")])
    assert result["sentences"] == len(test_docids)
    generated = (tmp_path / "results" / "bpt-table6" / "transformer-l32" / "generate-test.txt").read_text()
    assert "--document-samples chunks" in " ".join(evaluate.generate_command(
        load_config(config), data, run_dir / "checkpoint_last.pt", "test", cpu=True))
    hypothesis_ids = sorted(int(line.split("\t")[0][2:]) for line in generated.splitlines() if line.startswith("H-"))
    assert hypothesis_ids == list(range(len(test_docids)))  # chunks split back: each sentence once
    saved = json.loads((tmp_path / "results" / "bpt-table6" / "transformer-l32.json").read_text())
    assert saved["column"] == "32" and saved["row"] == "Transformer (full cross-attention)"
    assert saved["target_context"] == "same-pass" and saved["test_set"] == \
        "IWSLT15 zh-en TED.tst2010+TED.tst2011+TED.tst2012+TED.tst2013 (WIT3 xml)"
