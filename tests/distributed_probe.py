"""fairseq-train as torchrun starts it, then each rank saves what it holds (for tests/install/test_fairseq_edges.py).

    torchrun --standalone --nproc-per-node 2 tests/distributed_probe.py OUT_DIR <fairseq-train arguments>

Runs fairseq's own ``fairseq_cli.train.cli_main`` (the ``fairseq-train`` entry point) on the
rest of the command line. Afterwards every rank writes OUT_DIR/rank<r>.pt: the world size it
saw, its number of updates and its model's parameters.
"""

import sys

import torch
import torch.distributed as dist

from fairseq import trainer as fairseq_trainer
from fairseq_cli import train

_trainers = []
_original_init = fairseq_trainer.Trainer.__init__


def _recording_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _trainers.append(self)


if __name__ == "__main__":
    out_dir = sys.argv.pop(1)
    fairseq_trainer.Trainer.__init__ = _recording_init
    train.cli_main()
    (trainer,) = _trainers
    torch.save(
        {
            "world_size": dist.get_world_size(),
            "num_updates": trainer.get_num_updates(),
            "params": {k: v.detach().clone() for k, v in trainer.get_model().named_parameters()},
        },
        f"{out_dir}/rank{dist.get_rank()}.pt",
    )
