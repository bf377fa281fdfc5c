"""Reproduce one paper table end to end: prepare data, train, average, evaluate, tabulate.

    fairseq-plugins-reproduce --list                          # the tables, their rows and runs
    fairseq-plugins-reproduce bpt-table7 --list               # one table's rows (ids, labels, paper numbers)
    fairseq-plugins-reproduce bpt-table7                      # everything, on the paper's GPU count
    fairseq-plugins-reproduce bpt-table7 --dry-run            # the plan and every command in full
    fairseq-plugins-reproduce bpt-table4 --dry-run --explain  # ... with each value's source
    fairseq-plugins-reproduce bpt-table7 --gpus 2 --precision bf16 --stages train
    fairseq-plugins-reproduce bpt-table7 -- --max-update 20   # extra fairseq-train flags

TABLE is a shipped table's id or the path of a table file (``configs/<paper>/<table>.yaml``). The
cluster settings are options, or environment variables for cluster scripts: GPUS (per node; the
table's default is the paper's count, 0 = CPU), NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
PRECISION (fp16 on GPUs, fp32 on CPU), UPDATE_FREQ (auto: the paper's batch on these GPUs). On
several nodes, run the same command on each with its NODE_RANK; node 0 also evaluates.

Rows that describe the same model (same data, arch and options) train once. Each stage skips work
already done: prepared data-bins, finished results JSON; fairseq resumes interrupted training from
checkpoint_last.pt.

A table with ``measure: flops`` (TranSFormer's Table 8) trains nothing: each row's model is built
from its config and measured in-process (``measure_flops``), its JSON written beside the others.
So are the papers' measured figures (``measure: peak-memory | mirrored-summation | test-time``,
``figures/``: SegTree Figure 2, Multi-Scale Figures 2 and 4), on CUDA where there is one (``--gpus
0``: the CPU). After ``--``, a measured table takes ``--KEY VALUE`` pairs that replace its rows'
``evaluate`` settings (``segtree-figure2 -- --length 64``). A table whose rows cannot be built
here (Multi-Scale Figure 3) prints them, each with why.
"""

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Dict, List

import yaml

from ..command_line import command_parser
from . import evaluate, evaluate_classification, prepare_data, results_table, train
from .config import ConfigError, flatten, load_table, load_tables, run_key, seed_configs
from .data.language_modeling import check_format
from .tools import MissingTool, Tools

STAGES = ("prepare", "train", "evaluate", "table")


def _env(name: str, default, kind=str):
    value = os.environ.get(name)
    return default if value in (None, "") else kind(value)


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(description=__doc__)
    p.add_argument("table", nargs="?", help="a table id (--list shows them) or the path of a table file")
    p.add_argument("--list", action="store_true", help="list the tables (with TABLE: its rows) and exit")
    p.add_argument("--rows", help="comma-separated row ids: only these rows (default: every row)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {', '.join(STAGES)}")
    p.add_argument("--dry-run", action="store_true", help="print the plan and every command; run nothing")
    p.add_argument("--explain", action="store_true", help="with each row, every value and its source (a dry run)")
    p.add_argument("--gpus", type=int, default=_env("GPUS", None, int),
                   help="GPUs per node (env GPUS; default: the paper's count for the table; 0 = CPU)")
    p.add_argument("--nnodes", type=int, default=_env("NNODES", 1, int), help="nodes (env NNODES); run on each")
    p.add_argument("--node-rank", type=int, default=_env("NODE_RANK", 0, int),
                   help="this node's rank (env NODE_RANK); node 0 also evaluates and writes the table")
    p.add_argument("--master-addr", default=_env("MASTER_ADDR", ""), help="address of node 0 (env MASTER_ADDR)")
    p.add_argument("--master-port", type=int, default=_env("MASTER_PORT", 29500, int),
                   help="port of node 0 (env MASTER_PORT)")
    p.add_argument("--precision", choices=train.PRECISIONS, default=_env("PRECISION", None),
                   help="env PRECISION; default fp16 on GPUs, fp32 on CPU")
    p.add_argument("--update-freq", type=train.update_freq_arg, metavar="N|auto",
                   default=train.update_freq_arg(_env("UPDATE_FREQ", "auto")),
                   help="fairseq's --update-freq (env UPDATE_FREQ; auto: the paper's batch on these GPUs)")
    p.add_argument("--raw-dir", type=Path, help="local raw corpus files for the prepare stage (default: download)")
    p.add_argument("--data-root", type=Path, default=Path("data-bin"), help="prepared corpora: DATA_ROOT/<corpus>")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="checkpoints: RUNS_DIR/<run key>")
    p.add_argument("--results-dir", type=Path, default=Path("results"), help="scores: RESULTS_DIR/<table>/<row>.json")
    p.add_argument("--workers", type=int, default=8, help="data preparation processes")
    p.add_argument("--extra-parallel", type=Path, action="append", default=[], metavar="PREFIX",
                   help="more training data for the prepare stage (PREFIX.{src} / PREFIX.{tgt}: WMT17 Zh-En's "
                        "UN and CWMT corpora)")
    p.add_argument("--allow-less-training-data", action="store_true",
                   help="prepare a corpus smaller than the paper's (wmt17-zh-en on News Commentary alone)")
    return p


def list_tables() -> str:
    lines = []
    for table_id, table in sorted(load_tables().items()):
        if not table["configs"]:
            what = "not built"
        elif table["measure"] is None:
            what = f"{len({run_key(r) for c in table['configs'] for r in seed_configs(c)}):3} training runs"
        else:
            what = f"measured: {table['measure']}"
        lines.append(f"{table_id:20} {len(table['configs']):3} rows {what:28}  "
                     f"{table['file'].parent.name}/{table['file'].name}  {table['title']}")
    return "\n".join(lines)


def list_rows(table: Dict) -> str:
    lines = [f"{table['title']} ({table['table']}, {table['file']})"]
    for cfg in table["configs"]:
        paper = ", ".join(f"{m} {v}" for m, v in cfg["reported"].items()) or "no number"
        lines.append(f"  {table['table']}:{cfg['id']:28} {cfg['row']} | {cfg['column']} (paper: {paper})")
    for row in table["rows"]:
        if isinstance(row, dict):  # reported by the paper, not rerun
            lines.append(f"  {'(not run)':{len(table['table']) + 29}} {row['row']}: {row['why']}")
    return "\n".join(lines)


def explain(cfg: Dict) -> List[str]:
    """Every value the row sets, with its source."""
    flat = flatten(cfg)
    width = max(len(f"{k} = {v}") for k, v in flat.items())
    return [f"    {f'{k} = {v}':{width}}  {cfg['sources'][k]}" for k, v in flat.items()]


def evaluation_plan(cfg: Dict, data: Path, runs_dir: Path, results_dir: Path, cpu: bool, tools: Tools) -> List[str]:
    """What the evaluate stage runs for a row, command by command."""
    checkpoints = evaluate.row_checkpoints(cfg, runs_dir, [])
    lines = [f"fairseq-plugins-evaluate {cfg['table']}:{cfg['id']} --data {data} --runs-dir {runs_dir} "
             f"--results-dir {results_dir}    # -> {results_dir / cfg['name']}.json"]
    for checkpoint in checkpoints:
        average = evaluate.average_command(cfg, checkpoint.parent)
        if average:
            lines.append("  " + shlex.join(average))
    task = cfg["task"].get("task")
    if task in evaluate_classification.TASKS:
        metric = "accuracy and span F1" if task == "sequence_tagging" else "accuracy"
        runs = f"mean and deviation of {len(checkpoints)} runs" if len(checkpoints) > 1 else "one run"
        lines.append(f"  scored in-process ({metric} on {data} test, {runs}; options {cfg['evaluate'] or 'none'}): "
                     + " ".join(str(c) for c in checkpoints))
    elif task == "language_modeling":
        from .evaluate_lm import eval_lm_command

        lines.append("  " + shlex.join(eval_lm_command(cfg, data, checkpoints[0], "test", cpu, tools=tools)))
    else:
        lines.append("  " + shlex.join(evaluate.generate_command(cfg, data, checkpoints[0], "test", cpu,
                                                                 tools=tools)))
        lines.append(f"  then sacrebleu (tokenize {cfg.get('sacrebleu_tokenize') or 'by target language'}) on the "
                     f"detokenized output against {data}/test.raw.<target>, and tokenized BLEU")
    return lines


def _prepared(data: Path) -> bool:
    """A data-bin prepared in the current format (an earlier character format is prepared again)."""
    if not (data / "prep.json").exists():
        return False
    try:
        check_format(data)
    except ValueError as err:
        print(f"  {err}", flush=True)
        return False
    return True


def _runs(configs: List[Dict]) -> Dict[str, List[Dict]]:
    """Training runs by run key, each with the rows (one run per seed) it serves."""
    runs: Dict[str, List[Dict]] = {}
    for cfg in configs:
        for run in seed_configs(cfg):
            runs.setdefault(run_key(run), []).append(run)
    return runs


def main(argv=None) -> str:
    ours, extra = train.split_passthrough(argv)
    p = build_parser()
    args = p.parse_args(ours)
    try:
        return _main(p, args, extra)
    except (ConfigError, MissingTool, ValueError) as err:
        sys.exit(f"fairseq-plugins-reproduce: {err}")


def _main(p: argparse.ArgumentParser, args, extra: List[str]) -> str:
    if args.table is None:
        if not args.list:
            p.error("name a table (fairseq-plugins-reproduce --list shows them)")
        print(list_tables())
        return ""
    table = load_table(args.table)
    if args.list:
        print(list_rows(table))
        return ""
    if not table["configs"]:  # every row says why it is not built
        text = results_table.render(str(table["file"]), args.results_dir)
        print(f"{table['table']}: no row can be built here; each says why\n\n{text}", flush=True)
        return text
    stages = args.stages.split(",")
    unknown = set(stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
    configs = table["configs"]
    if args.rows:
        wanted = args.rows.split(",")
        missing = set(wanted) - {c["id"] for c in configs}
        if missing:
            raise ConfigError(f"{table['table']} has no rows {sorted(missing)} (--list shows them)")
        configs = [c for c in configs if c["id"] in wanted]
    if not configs:
        raise ConfigError(f"{table['table']} has no rows to run")
    dry_run = args.dry_run or args.explain
    if table["measure"] is not None:
        return _measure(table, [_overridden(c, extra) for c in configs], args, dry_run)
    paper_gpus = max(c["gpus"] for c in configs)
    gpus = paper_gpus if args.gpus is None else args.gpus
    if not dry_run and gpus > 0 and "train" in stages and train.local_devices() < gpus:
        whose = "the paper's count" if args.gpus is None else "--gpus"
        raise ConfigError(f"{table['table']} trains on {gpus} GPUs per node ({whose}), {train.local_devices()} "
                          f"visible here: --gpus N keeps the paper's batch with --update-freq, --gpus 0 trains on CPU")
    precision = args.precision or ("fp16" if gpus > 0 else "fp32")
    tools = Tools(dry_run=dry_run)
    runs = _runs(configs)
    print(f"{table['table']}: {len(configs)} rows, {len(runs)} training runs, {gpus} GPU(s) per node x {args.nnodes} "
          f"node(s) ({paper_gpus} in the paper), {precision}", flush=True)
    for i, (key, rows) in enumerate(runs.items(), 1):
        cfg = rows[0]
        data = args.data_root / cfg["data"]
        print(f"[{i}/{len(runs)}] {key}: " + ", ".join(sorted({f"{c['table']}:{c['id']}" for c in rows})), flush=True)
        if "prepare" in stages and not _prepared(data):
            cmd = [cfg["data"], "--out", str(data), "--workers", str(args.workers)]
            cmd += ["--raw-dir", str(args.raw_dir)] if args.raw_dir else []
            for prefix in args.extra_parallel:
                cmd += ["--extra-parallel", str(prefix)]
            cmd += ["--allow-less-training-data"] * args.allow_less_training_data
            print("  fairseq-plugins-prepare-data " + shlex.join(cmd), flush=True)
            if not dry_run:
                prepare_data.main(cmd)
        if "train" in stages:
            save_dir = args.runs_dir / key
            command = train.build_command(cfg, data, save_dir, gpus, args.nnodes, args.node_rank, args.master_addr,
                                          args.master_port, precision, extra, args.update_freq, tools)
            print("  " + shlex.join(command), flush=True)
            if args.explain:
                for row in rows:
                    print(f"  values of {row['table']}:{row['id']} ({row['row']} | {row['column']}):")
                    print("\n".join(explain(row)))
            if not dry_run:
                train.run_command(command, save_dir)
        if "evaluate" in stages and args.node_rank == 0:  # the other nodes only trained
            for row in rows:
                if run_key(seed_configs(row)[-1]) != key:
                    continue  # scored with its last seed's run, over all of them
                done = args.results_dir / f"{row['name']}.json"
                if done.exists():
                    print(f"  {row['name']}: already evaluated ({done})", flush=True)
                    continue
                plan = evaluation_plan(row, data, args.runs_dir, args.results_dir, gpus == 0, tools)
                print("\n".join("  " + line for line in plan), flush=True)
                if not dry_run:
                    evaluate.evaluate(row, data, evaluate.trained_checkpoints(row, args.runs_dir), "test",
                                      args.results_dir)
    if "table" in stages and args.node_rank == 0:
        print(f"fairseq-plugins-results-table {table['table']} --results-dir {args.results_dir}", flush=True)
    if tools.report():
        print(tools.report(), flush=True)
    if "table" not in stages or args.node_rank != 0 or dry_run:
        return ""
    return results_table.main([table["table"], "--results-dir", str(args.results_dir)])


def _overridden(cfg: Dict, extra: List[str]) -> Dict:
    """The row with the ``--KEY VALUE`` pairs given after ``--`` replacing its ``evaluate`` settings
    (values read as YAML: ``8`` an int, ``1e-3`` a string, ``0.001`` a float)."""
    if len(extra) % 2 or not all(flag.startswith("--") for flag in extra[::2]):
        raise ConfigError(f"after --, a measured table takes --KEY VALUE pairs of its rows' evaluate settings, "
                          f"got {shlex.join(extra)!r}")
    given = {flag[2:]: yaml.safe_load(value) for flag, value in zip(extra[::2], extra[1::2])}
    return dict(cfg, evaluate={**cfg["evaluate"], **given},
                sources={**cfg["sources"], **{f"evaluate.{k}": "ours: given after -- on the command line"
                                              for k in given}})


def _measure(table: Dict, configs: List[Dict], args, dry_run: bool) -> str:
    """A computed table: each row measured in-process, then tabulated like the others."""
    from . import figures, measure_flops  # torch and the models: only when a table is measured

    print(f"{table['table']}: {len(configs)} rows measured in-process ({table['measure']}), nothing trained",
          flush=True)
    for cfg in configs:
        if args.explain:
            print(f"  values of {cfg['table']}:{cfg['id']} ({cfg['row']} | {cfg['column']}):")
            print("\n".join(explain(cfg)))
    if table["measure"] == "flops":
        measure_flops.measure(configs, args.results_dir, dry_run)
    else:
        figures.measure(table["measure"], configs, args.results_dir, dry_run, cpu=args.gpus == 0)
    if dry_run or "table" not in args.stages.split(","):
        return ""
    return results_table.main([str(table["file"]), "--results-dir", str(args.results_dir)])


if __name__ == "__main__":
    main()
