"""Collect results into a Markdown table shaped like the paper's, paper numbers beside ours.

    fairseq-plugins-results-table bpt-table7 [--results-dir results] [--out results/bpt-table7.md]

Row order, columns and the rows we do not rerun (prior work, unimplemented ablations)
come from the table's file (``configs/<paper>/<table>.yaml``); our numbers from
``results/<table>/<row id>.json`` (written by fairseq-plugins-evaluate). Missing results show as
"-". Each row's notes give the test set and the sacrebleu signature of each of our numbers, and
mark document-level numbers that were not made with the model's own context (the oracle
reference context, or same-pass decoding).
"""

import json
import sys
from pathlib import Path
from typing import List

from ..command_line import command_parser
from .config import ConfigError, load_table, table_ids

METRIC_NAMES = {"sacrebleu": "SacreBLEU", "tokenized": "tok. BLEU", "bpc": "bpc", "ppl": "ppl", "accuracy": "Acc.",
                "f1": "F1", "gflops": "GFLOPs", "peak_mib": "peak MiB", "mse": "test MSE", "ms": "ms per batch",
                "percent": "%"}
CONTEXT_MARKS = {
    "oracle-reference": "**oracle context** (reference translations of the preceding sentences)",
    "same-pass": "context translated in the same beam search (same-pass)",
}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table_configs(table_id: str) -> List[dict]:
    """The resolved rows of a table (an id or a table file)."""
    return load_table(table_id)["configs"]


def render(table_id: str, results_dir: Path) -> str:
    spec = load_table(table_id)
    cells = {(c["row"], c["column"]): c for c in spec["configs"]}
    metrics = [spec["metric"], *spec.get("extra_metrics", [])]
    header = ["Model"]
    for col in spec["columns"]:
        for m in metrics:
            label = METRIC_NAMES[m] if len(spec["columns"]) == 1 else f"{col} {METRIC_NAMES[m]}"
            header += [f"{label} (paper)", f"{label} (ours)"]
    header.append("Notes")
    lines = [f"### {spec['title']}", "", "| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(header) - 2) + ["---"]) + "|"]
    labelled = set()
    for row in spec["rows"]:
        if isinstance(row, dict):  # reported only
            values = []
            for col in spec["columns"]:
                values += [_fmt(row["reported"].get(col)), "-"] + ["-", "-"] * (len(metrics) - 1)
            lines.append("| " + " | ".join([row["row"], *values, row["why"]]) + " |")
            continue
        labelled.add(row)
        values, notes = [], []
        for col in spec["columns"]:
            cfg = cells.get((row, col))
            if cfg is None:
                raise ValueError(f"{table_id}: no config for row {row!r}, column {col!r}")
            res_path = results_dir / f"{cfg['name']}.json"
            res = json.loads(res_path.read_text()) if res_path.exists() else {}
            for m in metrics:
                values += [_fmt(cfg["reported"].get(m)), _fmt(res.get(m))]
            if not res:
                notes.append(f"`{cfg['name']}` not evaluated")
                continue
            where = f"{col}: " if len(spec["columns"]) > 1 else ""
            signatures = [f"{METRIC_NAMES[m]} `{res[f'{m}_signature']}`" for m in metrics if f"{m}_signature" in res]
            if "measured_on" in res:  # a computed row (measure_flops, figures) says how it was measured
                notes.append(where + ", ".join([res["measured_on"], *signatures]))
            else:
                notes.append(where + f"{res.get('test_set', 'test set not recorded')}, " + ", ".join(signatures))
            if res.get("training_pairs", 0) < res.get("paper_training_pairs", 0):
                notes.append(where + f"trained on {res['training_pairs']:,} pairs, the paper on about "
                             f"{res['paper_training_pairs']:,}")
            if res.get("target_context") in CONTEXT_MARKS:
                notes.append(where + CONTEXT_MARKS[res["target_context"]])
        lines.append("| " + " | ".join([row, *values, "; ".join(notes)]) + " |")
    stray = {r for r, _ in cells} - labelled
    if stray:
        raise ValueError(f"{table_id}: rows not in the table's order: {sorted(stray)}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = command_parser(description=__doc__)
    p.add_argument("table", help=f"a table's id ({', '.join(sorted(table_ids()))}) or the path of a table file")
    p.add_argument("--results-dir", type=Path, default=Path("results"), help="where fairseq-plugins-evaluate wrote")
    p.add_argument("--out", type=Path, help="default: <results-dir>/<table>.md")
    args = p.parse_args(argv)
    try:
        table_id = load_table(args.table)["table"]
        text = render(args.table, args.results_dir)
    except ConfigError as err:
        sys.exit(f"fairseq-plugins-results-table: {err}")
    out = args.out or args.results_dir / f"{table_id}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(text)
    return text


if __name__ == "__main__":
    main()
