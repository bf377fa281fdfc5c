"""One progress display for the whole demo: each model's stage, its updates done out of the
total, and an ETA for the rest of the demo.

On a terminal it is one tqdm bar over the updates of all models. Anywhere else (a log file,
a pipe, CI) it writes whole lines, at a stage change and at most every ``interval``
seconds in between, so a log has no carriage returns.

The ETA adds, for what is left, the updates times the measured seconds per update (the
current model's own once it has one, else the mean of those measured so far) and, per model
not yet done, the mean time the finished models spent outside their timed updates (start-up,
validation, translation). Before the first model is done the second part is unknown and the
ETA is shown as a lower bound (``>``).
"""

import sys
import time
from typing import List, Optional, TextIO

from tqdm import tqdm

STAGES = ("waiting", "starting", "training", "translating", "done")


def clock(seconds: float) -> str:
    """1234 -> '20:34', 4000 -> '1:06:40'."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class DemoProgress:
    def __init__(self, names: List[str], updates: Optional[int], deadline: Optional[float] = None,
                 stream: Optional[TextIO] = None, interval: float = 30.0, tty: Optional[bool] = None,
                 now=time.monotonic):
        if not names:
            raise ValueError("no models to show progress for")
        self.names, self.updates, self.deadline = names, updates, deadline
        self.stream = stream or sys.stderr
        self.interval, self.now = interval, now
        self.tty = self.stream.isatty() if tty is None else tty
        self.stage = ["waiting"] * len(names)
        self.done_updates = [0] * len(names)
        self.seconds_per_update: List[Optional[float]] = [None] * len(names)
        self.started: List[Optional[float]] = [None] * len(names)
        self.other_seconds: List[float] = []  # per finished model: its time outside timed updates
        self.current = 0
        self.last_line = -float("inf")
        self.bar = None
        if self.tty:
            total = updates * len(names) if updates else None
            self.bar = tqdm(total=total, file=self.stream, unit="upd", dynamic_ncols=True,
                            bar_format="{desc} {bar} {n_fmt}/{total_fmt} updates [{elapsed}{postfix}]"
                            if total else "{desc} {n_fmt} updates [{elapsed}{postfix}]")

    # -- what the demo reports ---------------------------------------------------------------
    def set_stage(self, index: int, stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; one of {STAGES}")
        self.current = index
        if stage == "starting":
            self.started[index] = self.now()
        self.stage[index] = stage
        self.show(force=True)

    def trained(self, index: int, updates: int, seconds_per_update: Optional[float]) -> None:
        """``updates`` done so far; the first report moves the model from starting to training."""
        if self.bar is not None:
            self.bar.update(max(0, updates - self.done_updates[index]))
        self.done_updates[index] = updates
        if seconds_per_update is not None:
            self.seconds_per_update[index] = seconds_per_update
        if self.stage[index] == "starting":
            self.set_stage(index, "training")
        else:
            self.show()

    def finished(self, index: int) -> None:
        """The model is trained and translated: learn its time outside the timed updates."""
        spent = self.now() - self.started[index]
        spu = self.seconds_per_update[index] or 0.0
        self.other_seconds.append(max(0.0, spent - spu * self.done_updates[index]))
        self.set_stage(index, "done")

    def write(self, message: str) -> None:
        """A message between progress lines (tqdm keeps the bar below it on a terminal)."""
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    # -- estimate ----------------------------------------------------------------------------
    def eta(self):
        """(seconds left, lower bound?) or (None, True) before any speed is measured."""
        if self.deadline is not None and (self.updates is None or self.now() >= self.deadline):
            return max(0.0, self.deadline - self.now()), False
        measured = [s for s in self.seconds_per_update if s is not None]
        if not measured:
            return None, True
        mean_spu = sum(measured) / len(measured)
        left, lower = 0.0, not self.other_seconds
        other = sum(self.other_seconds) / len(self.other_seconds) if self.other_seconds else 0.0
        for i, stage in enumerate(self.stage):
            if stage == "done":
                continue
            spu = self.seconds_per_update[i] or mean_spu
            left += spu * (self.updates - self.done_updates[i])
            if stage == "translating":
                left += max(0.0, other - (self.now() - self.started[i]) + spu * self.updates)
            else:
                left += other
        if self.deadline is not None:  # a time budget ends the demo early at the latest
            left = min(left, max(0.0, self.deadline - self.now()))
        return left, lower

    def status(self) -> str:
        i = self.current
        n = len(self.names)
        of = f"/{self.updates}" if self.updates else ""
        what = f"{i + 1}/{n} {self.names[i]}: {self.stage[i]} {self.done_updates[i]}{of} updates"
        left, lower = self.eta()
        eta = "ETA ?" if left is None else f"ETA {'>' if lower else ''}{clock(left)}"
        return f"{what}; {eta}"

    def show(self, force: bool = False) -> None:
        if self.bar is not None:
            i = self.current
            self.bar.set_description_str(f"{i + 1}/{len(self.names)} {self.names[i]}: {self.stage[i]}",
                                         refresh=False)
            left, lower = self.eta()
            self.bar.set_postfix_str(
                "ETA ?" if left is None else f"ETA {'>' if lower else ''}{clock(left)}", refresh=True)
            return
        t = self.now()
        if force or t - self.last_line >= self.interval:
            self.last_line = t
            total = sum(self.done_updates)
            of = f"/{self.updates * len(self.names)}" if self.updates else ""
            print(f"[demo] {self.status()} (all models {total}{of} updates)", file=self.stream, flush=True)
