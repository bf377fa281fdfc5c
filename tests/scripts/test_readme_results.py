"""scripts/readme_results.py: the README's results table is the one rendered from the committed
quality study, and the rendering picks each model's newest run beside that run's baseline."""

import copy
import json

import pytest

from scripts import readme_results

DATA = json.loads(readme_results.DATA.read_text(encoding="utf-8"))


def test_the_readme_table_is_the_rendered_one():
    text = readme_results.README.read_text(encoding="utf-8")
    assert readme_results.replace_block(text, readme_results.render(DATA)) == text, (
        "README.md's results table differs from benchmarks/quality_study.json: run python scripts/readme_results.py")


def test_check_fails_on_an_edited_table(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(readme_results.README.read_text(encoding="utf-8").replace("| 21.56 ± 0.87 |", "| 21.70 ± 0.87 |"))
    assert readme_results.main(["--check", "--readme", str(readme)]) == 1
    assert "differs" in capsys.readouterr().err
    assert readme_results.main(["--readme", str(readme)]) == 0  # rewrites it
    assert readme_results.main(["--check", "--readme", str(readme)]) == 0


def _run(label, rows, comparisons):
    return {"label": label, "date": "d", "rows": rows, "comparisons": comparisons}


def _row(key, mean, seeds=(1, 2, 3)):
    scores = [mean - 1, mean, mean + 1][: len(seeds)]
    return {"key": key, "name": key, "updates": readme_results.UPDATES, "params": 1000, "seeds": list(seeds),
            "scores": scores, "sacrebleu": {"mean": mean, "std": 1.0}, "valid_loss": {"mean": 5.0, "std": 0.01}}


def _cmp(key, diff):
    return {"key": key, "reference": readme_results.BASELINE, "updates": readme_results.UPDATES,
            "sacrebleu": {"diff": diff, "se": 0.5}}


def test_each_model_comes_from_its_newest_run_beside_that_runs_baseline(monkeypatch):
    models = {"transformer_postnorm": "T", "bpt_transformer": "B", "ms_transformer": "M"}
    monkeypatch.setattr(readme_results, "MODELS", models)
    old = _run("old", [_row("transformer_postnorm", 18.0), _row("bpt_transformer", 20.0), _row("ms_transformer", 19.0)],
               [_cmp("bpt_transformer", 2.0), _cmp("ms_transformer", 1.0)])
    new = _run("new", [_row("transformer_postnorm", 18.5), _row("bpt_transformer", 21.0)],
               [_cmp("bpt_transformer", 2.5)])
    table = readme_results.render({"runs": [old, new]})
    lines = table.splitlines()[2:]
    assert lines == ["| *new, d* | | | | | |",
                     "| T | 18.50 ± 1.00 | 17.50 | - | 5.000 ± 0.010 | 1,000 |",
                     "| B | 21.00 ± 1.00 | 20.00 | +2.50 ± 0.50 | 5.000 ± 0.010 | 1,000 |",
                     "| *old, d* | | | | | |",
                     "| T | 18.00 ± 1.00 | 17.00 | - | 5.000 ± 0.010 | 1,000 |",
                     "| M | 19.00 ± 1.00 | 18.00 | +1.00 ± 0.50 | 5.000 ± 0.010 | 1,000 |"]
    no_ms = copy.deepcopy(new)
    with pytest.raises(ValueError, match="ms_transformer"):
        readme_results.render({"runs": [no_ms]})
    no_baseline = _run("x", [_row("bpt_transformer", 21.0), _row("ms_transformer", 19.0)], [])
    with pytest.raises(ValueError, match="no transformer_postnorm row"):
        readme_results.render({"runs": [no_baseline]})


def test_markers_must_be_there_once():
    with pytest.raises(ValueError, match="markers"):
        readme_results.replace_block("# README without a table\n", "| t |\n")
    twice = f"{readme_results.BEGIN}\n{readme_results.END}\n" * 2
    with pytest.raises(ValueError, match="markers"):
        readme_results.replace_block(twice, "| t |\n")
