"""Average the parameters of the last N checkpoints of a fairseq run.

fairseq ships its averaging script only in the git repository, not in the wheel. This
one averages the last N checkpoints of a run (or explicit paths) and writes a checkpoint
fairseq-generate loads like any other: the newest input's fields (``cfg``, ``args``, ...)
with the averaged ``model`` state. The last N are the ``checkpoint{epoch}.pt`` files of the
highest epochs, and ``checkpoint_last.pt`` when it holds more updates than the newest of
them: training that stops at ``--max-update`` inside an epoch saves that final, partial
epoch only there.

    fairseq-plugins-average-checkpoints runs/RUN --last 10 --output runs/RUN/checkpoint_avg10.pt
"""

import re
from pathlib import Path
from typing import List, Sequence

import torch

from ..command_line import command_parser

_EPOCH_RE = re.compile(r"^checkpoint(\d+)\.pt$")


def last_checkpoints(run_dir: Path, n: int) -> List[Path]:
    """The ``n`` newest checkpoints of a run, oldest first: epoch checkpoints by epoch number,
    then ``checkpoint_last.pt`` if it is newer than all of them (a final partial epoch)."""
    epochs = sorted((int(m.group(1)), p) for p in Path(run_dir).iterdir() if (m := _EPOCH_RE.match(p.name)))
    found = [p for _, p in epochs]
    last = Path(run_dir) / "checkpoint_last.pt"
    if last.exists() and (not found or num_updates(last) > num_updates(found[-1])):
        found.append(last)
    if len(found) < n:
        raise FileNotFoundError(f"{run_dir}: asked to average {n} checkpoints, found "
                                f"{len(found)} ({[p.name for p in found]})")
    return found[-n:]


def num_updates(path: Path) -> int:
    """Updates trained when the checkpoint was saved (fairseq's optimizer history)."""
    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return state["optimizer_history"][-1]["num_updates"]


def average(paths: Sequence[Path]) -> dict:
    """Mean of the floating-point tensors of every ``model`` state; other entries must agree."""
    if not paths:
        raise ValueError("no checkpoints to average")
    total, newest = None, None
    for path in paths:
        state = torch.load(path, map_location="cpu", weights_only=False)
        params = state["model"]
        if total is None:
            total = {k: v.double() if v.is_floating_point() else v.clone() for k, v in params.items()}
        else:
            if params.keys() != total.keys():
                raise ValueError(f"{path}: parameter names differ from {paths[0]}")
            for k, v in params.items():
                if v.is_floating_point():
                    total[k] += v.double()
                elif not torch.equal(v, total[k]):
                    raise ValueError(f"{path}: non-float entry {k} differs between checkpoints")
        newest = state
    averaged = {k: (v / len(paths)).to(newest["model"][k].dtype) if v.is_floating_point() else v
                for k, v in total.items()}
    return dict(newest, model=averaged)


def main(argv=None) -> Path:
    p = command_parser(description=__doc__)
    p.add_argument("inputs", nargs="+", type=Path, help="a run directory (with --last) or checkpoint files")
    p.add_argument("--last", type=int, help="average the last N checkpoints of the run directory (epoch "
                   "checkpoints, and checkpoint_last.pt when it is newer)")
    p.add_argument("--output", type=Path, required=True, help="the averaged checkpoint file to write")
    args = p.parse_args(argv)
    if args.last is not None:
        if len(args.inputs) != 1 or not args.inputs[0].is_dir():
            p.error("--last takes exactly one run directory")
        if args.last < 1:
            p.error("--last must be >= 1")
        paths = last_checkpoints(args.inputs[0], args.last)
    else:
        paths = args.inputs
    print("averaging " + ", ".join(str(x) for x in paths), flush=True)
    torch.save(average(paths), args.output)
    return args.output


if __name__ == "__main__":
    main()
