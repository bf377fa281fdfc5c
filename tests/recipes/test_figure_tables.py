"""The papers' measured figures as tables (``measure: peak-memory | mirrored-summation |
test-time``): each dry run prints what every row will measure and writes nothing; a tiny real run
writes each row's results JSON and prints the table; Multi-Scale Figure 3's rows say why they are
not built; bad measure kinds, row settings and overrides are refused in one line."""

import json

import pytest
import yaml

pytest.importorskip("fairseq")

from fairseq_plugins.recipes import reproduce_table  # noqa: E402
from fairseq_plugins.recipes.config import ConfigError, load_table  # noqa: E402
from fairseq_plugins.recipes.figures import segtree_memory  # noqa: E402

FIGURES = {"segtree-figure2": ("peak-memory", 20), "ms-figure2": ("mirrored-summation", 25),
           "ms-figure4": ("test-time", 9)}
TINY_LM = {"layers": 1, "vocab": 40, "dim": 16, "ffn": 32, "batch": 2, "heads": 2}


def _run(capsys, table, results, *options):
    text = reproduce_table.main([table, "--gpus", "0", "--results-dir", str(results), *options])
    return text, capsys.readouterr().out


@pytest.mark.parametrize("table", sorted(FIGURES))
def test_dry_run_prints_what_every_row_measures_and_writes_nothing(table, tmp_path, capsys):
    measure, rows = FIGURES[table]
    _, out = _run(capsys, table, tmp_path, "--dry-run")
    assert out.startswith(f"{table}: {rows} rows measured in-process ({measure}), nothing trained")
    lines = out.splitlines()
    for cfg in load_table(table)["configs"]:  # one line per row, naming every setting of its point
        line = next(line for line in lines if line.endswith(f"# -> {tmp_path}/{cfg['name']}.json"))
        assert line.startswith("  measured in-process on CPU: ")
        assert all(str(value) in line for value in cfg["evaluate"].values()), (line, cfg["evaluate"])
    assert "fairseq-train" not in out and not list(tmp_path.iterdir())


def test_segtree_figure2_tiny_run_writes_each_rows_json_and_the_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(segtree_memory.SETTINGS, 1, TINY_LM)
    text, _ = _run(capsys, "segtree-figure2", tmp_path, "--rows", "transformer-s1-n128,segtree-s1-n128",
                   "--", "--length", "8")
    results = {m: json.loads((tmp_path / "segtree-figure2" / f"{m}-s1-n128.json").read_text())
               for m in ("transformer", "segtree")}
    for result in results.values():
        assert result["length"] == 8 and result["peak_mib"] * 2**20 == result["peak_step_bytes"] > 0
        assert result["peak_step_bytes"] >= 2 * 8 * 40 * 4  # the logits alone (batch x length x vocabulary, fp32)
        assert f"| {result['model']} (setting 1) | - | {result['peak_mib']:.2f} | - |" in text
    # the same sizes (SegTree adds only its relative level embeddings)
    assert 1 < results["segtree"]["parameter_bytes"] / results["transformer"]["parameter_bytes"] < 1.1
    assert "8 tokens; CPU allocator events" in text and "`segtree-figure2/segtree-s2-n2048` not evaluated" in text
    assert (tmp_path / "segtree-figure2.md").read_text() == text


def test_ms_figure2_tiny_run_trains_each_row_and_prints_the_table(tmp_path, capsys):
    text, out = _run(capsys, "ms-figure2", tmp_path, "--rows", "ms-trans-flex-k10,transformer-k10", "--",
                     "--length", "16", "--k", "2", "--dim", "10", "--steps", "2", "--batch", "4",
                     "--test-samples", "16")
    for row, name in (("ms-trans-flex-k10", "MS-Trans-Flex"), ("transformer-k10", "Transformer")):
        result = json.loads((tmp_path / "ms-figure2" / f"{row}.json").read_text())
        assert result["model"] == name and result["k"] == 2 and result["mse"] > 0
        assert result["relative_mse"] > 0 and f"| {name} | - | {result['mse']:.2f} | - |" in text
    assert "trained at K 2 (N 16, d 50, hidden 10; 2 Adam updates of 4 fresh samples" in text
    assert "bilstm-k10.json" not in out and len(list((tmp_path / "ms-figure2").iterdir())) == 2  # --rows


def test_ms_figure4_tiny_run_times_one_lengths_rows_together(tmp_path, capsys):
    rows = "ms-trans-n21,transformer-n21,bilstm-n21"
    text, _ = _run(capsys, "ms-figure4", tmp_path, "--rows", rows, "--", "--batch", "2", "--repeats", "1")
    results = {r: json.loads((tmp_path / "ms-figure4" / f"{r}.json").read_text()) for r in rows.split(",")}
    assert all(r["ms"] > 0 and r["length"] == 21 and r["batch"] == 2 for r in results.values())
    assert "timed alternating with MS-Trans, BiLSTM; 1.00 x the Transformer's" in text
    assert f"| BiLSTM | - | - | - | {results['bilstm-n21']['ms']:.2f} | - | - |" in text
    before = {r: (tmp_path / "ms-figure4" / f"{r}.json").read_text() for r in results}
    # rows measured with these settings are kept, not measured again
    _run(capsys, "ms-figure4", tmp_path, "--rows", rows, "--", "--batch", "2", "--repeats", "1")
    assert before == {r: (tmp_path / "ms-figure4" / f"{r}.json").read_text() for r in results}


def test_ms_figure3_rows_say_why_they_are_not_built(tmp_path, capsys):
    text, out = _run(capsys, "ms-figure3", tmp_path)
    assert out.startswith("ms-figure3: no row can be built here; each says why")
    assert text.count("| - | - | not built: needs a pretrained BERT-base checkpoint") == 6
    assert not list(tmp_path.iterdir())
    reproduce_table.main(["--list"])
    assert any(line.startswith("ms-figure3") and "0 rows not built" in line
               for line in capsys.readouterr().out.splitlines())
    reproduce_table.main(["ms-figure3", "--list"])
    assert capsys.readouterr().out.count(": not built: needs a pretrained BERT-base checkpoint") == 6


def _table(tmp_path, **changes):
    spec = {"table": "tiny-figure", "title": "Tiny", "paper": "multiscale", "metric": "ms", "measure": "test-time",
            "columns": ["MR"],
            "rows": [{"id": "tiny", "row": "Tiny", "column": "MR",
                      "evaluate": {"model": "BiLSTM", "dataset": "MR", "length": 3, "batch": 1, "repeats": 1},
                      "sources": {f"evaluate.{k}": "ours: t" for k in ("model", "dataset", "length", "batch",
                                                                       "repeats")}}]}
    spec.update(changes)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_bad_measure_kinds_settings_and_overrides_are_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"measure must be one of \['flops', 'peak-memory', 'mirrored-summation', "
                                          r"'test-time'\], got 'figure'"):
        load_table(_table(tmp_path, measure="figure"))
    for extra, message in ((["--model", "LSTM"], "tiny-figure/tiny: evaluate.model must be one of ['MS-Trans', "
                                                 "'Transformer', 'BiLSTM'], got 'LSTM'"),
                           (["--length", "0"], "evaluate.length, batch and repeats must be at least 1"),
                           (["--length", "x"], "evaluate.length must be an integer, got 'x'"),
                           (["--heads", "2"], "unknown ['heads']"),
                           (["--length"], "after --, a measured table takes --KEY VALUE pairs")):
        with pytest.raises(SystemExit) as err:
            reproduce_table.main([_table(tmp_path), "--dry-run", "--", *extra])
        assert message in str(err.value) and "\n" not in str(err.value)


def test_a_point_measured_with_other_settings_is_measured_again(tmp_path, capsys):
    """A tiny run's JSON never passes for the row's point: a rerun with the same settings skips
    it, one with other settings (here more steps) measures it again."""
    tiny = ["--rows", "transformer-k10", "--", "--length", "16", "--k", "2", "--dim", "10", "--batch", "4",
            "--test-samples", "16", "--steps"]
    result = tmp_path / "ms-figure2" / "transformer-k10.json"
    _run(capsys, "ms-figure2", tmp_path, *tiny, "2")
    first = result.read_text()
    assert json.loads(first)["settings"]["steps"] == 2
    _, out = _run(capsys, "ms-figure2", tmp_path, *tiny, "2")
    assert result.read_text() == first and "measuring again" not in out
    _, out = _run(capsys, "ms-figure2", tmp_path, *tiny, "3")
    assert "transformer-k10.json was measured with other settings" in out
    assert json.loads(result.read_text())["settings"]["steps"] == 3
