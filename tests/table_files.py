"""Table files written by tests: one row, every value sourced as the test's own choice."""

from pathlib import Path

import yaml

from fairseq_plugins.recipes.config import flatten


def one_row_table(path: Path, row_id: str = "tiny", table: str = "test-table", paper: str = "bpt",
                  metric: str = "sacrebleu", row: str = "Tiny", reported=None, **settings) -> str:
    """Write a table file of one row with ``settings`` (data, arch, task, model, ...); returns its row
    reference (``PATH:ROW_ID``)."""
    sources = {key: "ours: a test's tiny setting" for key in flatten(settings)}
    spec = {"table": table, "title": f"{table} (test)", "paper": paper, "metric": metric,
            "rows": [{"id": row_id, "row": row, "reported": reported or {}, **settings, "sources": sources}]}
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return f"{path}:{row_id}"
