"""Reproduce one paper table end to end: prepare data, train, average, evaluate, tabulate.

    fairseq-plugins-reproduce bpt-table7                   # everything
    fairseq-plugins-reproduce bpt-table7 --dry-run         # show the plan and commands
    fairseq-plugins-reproduce slowfast-table5 --stages evaluate,table
    fairseq-plugins-reproduce bpt-table7 -- --max-update 20   # extra fairseq-train flags
    bash scripts/tables/bpt_table7.sh --dry-run                     # the same, with its GPU settings

Rows that describe the same model (same data, arch and options) train once. Each stage
skips work already done: prepared data-bins, finished results JSON; fairseq resumes
interrupted training from checkpoint_last.pt.
"""

import sys
from pathlib import Path

from ..command_line import command_parser
from . import evaluate, prepare_data, results_table, train
from .config import CONFIG_DIR, load_tables, run_key, seed_configs

STAGES = ("prepare", "train", "evaluate", "table")


def main(argv=None) -> str:
    ours, extra = train.split_passthrough(argv)
    p = command_parser(description=__doc__)
    p.add_argument("table", choices=sorted(load_tables()), help="the paper table to reproduce (configs/tables.yaml)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    p.add_argument("--raw-dir", type=Path, help="local raw corpus files (default: download)")
    p.add_argument("--data-root", type=Path, default=Path("data-bin"),
                   help="where the data-bins go, one folder per corpus (default: data-bin)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"),
                   help="where each run's checkpoints go (default: runs)")
    p.add_argument("--results-dir", type=Path, default=Path("results"),
                   help="where the scores and the table go (default: results)")
    p.add_argument("--workers", type=int, default=8, help="data preparation processes")
    p.add_argument("--extra-parallel", type=Path, action="append", default=[], metavar="PREFIX",
                   help="more training data for the prepare stage (PREFIX.{src} / PREFIX.{tgt}: WMT17 Zh-En's "
                        "UN and CWMT corpora)")
    p.add_argument("--allow-less-training-data", action="store_true",
                   help="prepare a corpus smaller than the paper's (wmt17-zh-en on News Commentary alone)")
    p.add_argument("--world-size", type=int, help="GPUs per node (default: all visible; 0 = CPU)")
    p.add_argument("--update-freq", type=train.update_freq_arg, default=None, metavar="N|auto",
                   help="fairseq's --update-freq (default auto: the paper's batch on these GPUs)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes; run the command on each (torchrun)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank; node 0 evaluates")
    p.add_argument("--master-addr", default="", help="address of node 0 (several nodes)")
    p.add_argument("--master-port", type=int, default=29500, help="port of node 0 (several nodes; default 29500)")
    p.add_argument("--fp16", action="store_true", help="mixed precision (GPU)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands only")
    args = p.parse_args(ours)
    stages = args.stages.split(",")
    unknown = set(stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    configs = results_table.table_configs(args.table)
    if not configs:
        sys.exit(f"{args.table} has no configs to run")
    runs = {}
    for cfg in configs:
        for run in seed_configs(cfg):  # a config with the paper's seed protocol trains once per seed
            runs.setdefault(run_key(run), []).append(run)
    print(f"{args.table}: {len(configs)} rows, {len(runs)} training runs", flush=True)
    for i, (key, cfgs) in enumerate(runs.items(), 1):
        cfg = cfgs[0]
        data = args.data_root / cfg["data"]
        print(f"[{i}/{len(runs)}] {key}: " + ", ".join(c["name"] for c in cfgs), flush=True)
        if "prepare" in stages and not (data / "prep.json").exists():
            cmd = [cfg["data"], "--out", str(data), "--workers", str(args.workers)]
            if args.raw_dir:
                cmd += ["--raw-dir", str(args.raw_dir)]
            for prefix in args.extra_parallel:
                cmd += ["--extra-parallel", str(prefix)]
            cmd += ["--allow-less-training-data"] * args.allow_less_training_data
            print("  fairseq-plugins-prepare-data " + " ".join(cmd), flush=True)
            if not args.dry_run:
                prepare_data.main(cmd)
        cfg_path = str(CONFIG_DIR / f"{cfg['name']}.yaml")
        if "train" in stages:
            targs = [cfg_path, "--data", str(data), "--runs-dir", str(args.runs_dir)]
            if args.world_size is not None:
                targs += ["--world-size", str(args.world_size)]
            if args.update_freq is not None:
                targs += ["--update-freq", str(args.update_freq)]
            if args.nnodes > 1:
                targs += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank),
                          "--master-addr", args.master_addr, "--master-port", str(args.master_port)]
            targs += ["--fp16"] * args.fp16 + ["--dry-run"] * args.dry_run
            if cfg.get("seeds"):
                targs += ["--seed", str(cfg["train"]["seed"])]
            train.main(targs + (["--", *extra] if extra else []))
        if "evaluate" in stages and args.node_rank == 0:  # the other nodes only trained
            for c in cfgs:
                if run_key(seed_configs(c)[-1]) != key:
                    continue  # scored with its last seed's run, over all of them
                done = args.results_dir / f"{c['name']}.json"
                if done.exists():
                    print(f"  {c['name']}: already evaluated ({done})", flush=True)
                elif args.dry_run:
                    print(f"  fairseq-plugins-evaluate configs/{c['name']}.yaml", flush=True)
                else:
                    ckpt = evaluate.checkpoint_for(c, args.runs_dir / key)
                    evaluate.evaluate(c, data, ckpt, "test", args.results_dir)
    if "table" not in stages or args.node_rank != 0:
        return ""
    return results_table.main([args.table, "--results-dir", str(args.results_dir)])


if __name__ == "__main__":
    main()
