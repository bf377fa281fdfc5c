"""Train one table row with fairseq-train.

    fairseq-plugins-train bpt-table7:bpt-k4                              # all local GPUs (or CPU)
    fairseq-plugins-train ROW --world-size 4 --precision fp16            # 4 GPUs on this node
    fairseq-plugins-train ROW --nnodes 2 --node-rank 0 --master-addr HOST   # multi-node (torchrun)
    fairseq-plugins-train ROW -- --max-update 100                        # extra fairseq-train flags

ROW is ``TABLE:ROW_ID``: a table's id or the path of a table file, and the row's id
(``fairseq-plugins-reproduce TABLE --list`` lists them).

The paper's batch is kept on fewer devices by scaling ``--update-freq`` (config ``gpus``), unless
``--update-freq N`` is given.
Checkpoints go to ``runs/<run key>`` (shared by configs that describe the same model);
fairseq resumes from ``checkpoint_last.pt`` there when rerun.
"""

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from ..command_line import command_parser
from .config import ConfigError, load_config, run_key, seed_configs, train_flags
from .data.language_modeling import check_format
from .tools import MissingTool, Tools

PRECISIONS = ("fp32", "fp16", "bf16")  # fairseq-train: none, --fp16, --bf16 (mixed precision, GPU)


def default_data_dir(cfg) -> Path:
    return Path("data-bin") / cfg["data"]


def local_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def build_command(cfg, data: Path, save_dir: Path, gpus_per_node: int, nnodes: int = 1,
                  node_rank: int = 0, master_addr: str = "", master_port: int = 29500,
                  precision: str = "fp32", extra: List[str] = (), update_freq: Optional[int] = None,
                  tools: Optional[Tools] = None) -> List[str]:
    """The fairseq-train command line (wrapped in torchrun for several nodes)."""
    tools = tools or Tools()
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    world = max(1, gpus_per_node) * nnodes
    cmd = [tools("fairseq-train"), str(data), "--save-dir", str(save_dir), *train_flags(cfg, world, update_freq)]
    if gpus_per_node == 0:
        if nnodes > 1:
            raise ValueError("multi-node training needs GPUs")
        if precision != "fp32":
            raise ValueError(f"--precision {precision} needs GPUs; on CPU, train in fp32")
        cmd.append("--cpu")
    elif world > 1:
        cmd += ["--distributed-world-size", str(world)]
    if precision != "fp32":
        cmd.append(f"--{precision}")
    cmd += list(extra)
    if nnodes > 1:
        if not master_addr:
            raise ValueError("--nnodes > 1 needs --master-addr")
        cmd = [tools("torchrun"), f"--nproc_per_node={gpus_per_node}", f"--nnodes={nnodes}",
               f"--node_rank={node_rank}", f"--master_addr={master_addr}",
               f"--master_port={master_port}", *cmd]
    return cmd


def run_command(cmd: List[str], save_dir: Path) -> None:
    """Run a fairseq-train command into its run folder (fairseq resumes from checkpoint_last.pt there)."""
    save_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd, check=True)


def update_freq_arg(value: str) -> Optional[int]:
    """``auto`` (None: keep the paper's batch) or a positive number of batches per update."""
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(description=__doc__)
    p.add_argument("config", metavar="ROW", help="TABLE:ROW_ID, e.g. bpt-table7:bpt-k4 (TABLE: an id or a table file)")
    p.add_argument("--data", type=Path, help="data-bin directory (default: data-bin/<corpus>)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="checkpoints go to RUNS_DIR/<run key>")
    p.add_argument("--world-size", type=int, help="GPUs per node (default: all visible; 0 = CPU)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes; run the command on each (torchrun)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank")
    p.add_argument("--master-addr", default="", help="address of node 0 (several nodes)")
    p.add_argument("--master-port", type=int, default=29500, help="port of node 0 (several nodes)")
    p.add_argument("--update-freq", type=update_freq_arg, default=None, metavar="N|auto",
                   help="fairseq's --update-freq (default auto: the paper's batch on these devices)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="mixed precision on GPUs: fp16 or bf16")
    p.add_argument("--dry-run", action="store_true", help="print the command only")
    p.add_argument("--seed", type=int, help="a config with seeds: train only this seed's run (default: every seed)")
    return p


def split_passthrough(argv):
    """(our args, fairseq args): everything after a bare ``--`` goes to fairseq."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv=None) -> Path:
    ours, extra = split_passthrough(argv)
    args = build_parser().parse_args(ours)
    try:
        cfg = load_config(args.config)
    except ConfigError as err:
        sys.exit(f"fairseq-plugins-train: {err}")
    data = args.data or default_data_dir(cfg)
    if not args.dry_run and not data.is_dir():
        sys.exit(f"{data} does not exist: fairseq-plugins-prepare-data {cfg['data']} --out {data}")
    try:
        check_format(data)
    except ValueError as err:
        sys.exit(f"fairseq-plugins-train: {err}")
    runs = seed_configs(cfg)
    if args.seed is not None:
        runs = [run for run in runs if run["train"].get("seed") == args.seed]
        if not runs:
            sys.exit(f"--seed {args.seed}: {args.config} has seeds 1..{cfg.get('seeds', 0)}")
    gpus = local_devices() if args.world_size is None else args.world_size
    tools = Tools(dry_run=args.dry_run)
    for run in runs:  # the paper's seed protocol: one run per seed, one after the other
        save_dir = args.runs_dir / run_key(run)
        try:
            cmd = build_command(run, data, save_dir, gpus, args.nnodes, args.node_rank, args.master_addr,
                                args.master_port, args.precision, extra, args.update_freq, tools)
        except (MissingTool, ValueError) as err:
            sys.exit(f"fairseq-plugins-train: {err}")
        print(shlex.join(cmd), flush=True)
        if not args.dry_run:
            run_command(cmd, save_dir)
    if tools.report():
        print(tools.report(), flush=True)
    return save_dir


if __name__ == "__main__":
    main()
