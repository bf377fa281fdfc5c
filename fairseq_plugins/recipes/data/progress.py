"""What the long steps of a data preparation show while they run: ``[prepare]`` log lines, a
progress bar with rate and ETA on a terminal (one summary line in a log file), and
``map_lines``, which runs a step over many lines in worker processes behind such a bar."""

import multiprocessing
import sys
import time
from typing import Callable, List, Optional

from tqdm import tqdm


def log(msg: str) -> None:
    print(f"[prepare] {msg}", file=sys.stderr, flush=True)


class Progress:
    """A tqdm bar with rate and ETA on a terminal; in a log file (no TTY) no bar, only one line with
    the count and the time when it ends (bars would fill a log with carriage-return updates)."""

    def __init__(self, total: Optional[int], what: str, unit: str = " lines", **tqdm_kwargs):
        self.what, self.unit, self.n, self.start = what, unit, 0, time.monotonic()
        self.bar = tqdm(total=total, desc=f"[prepare] {what}", unit=unit, mininterval=1.0,
                        file=sys.stderr, disable=None, **tqdm_kwargs)
        self.in_log = bool(self.bar.disable)  # tqdm turned itself off: stderr is no terminal

    def update(self, n: int = 1) -> None:
        self.n += n
        self.bar.update(n)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
        if self.in_log and exc[0] is None:
            log(f"{self.what}: {self.n:,}{self.unit} in {time.monotonic() - self.start:.0f} s")


def map_lines(fn: Callable[[str], str], lines: List[str], workers: int, what: str,
              initializer=None, initargs=()) -> List[str]:
    """Apply ``fn`` to every line, in ``workers`` processes, with a progress bar and ETA."""
    if workers <= 1:
        if initializer:
            initializer(*initargs)
        it, pool = map(fn, lines), None
    else:
        pool = multiprocessing.get_context("fork").Pool(workers, initializer, initargs)
        it = pool.imap(fn, lines, chunksize=2000)
    out = []
    try:
        with Progress(len(lines), what) as bar:
            for line in it:
                out.append(line)
                bar.update()
        return out
    finally:
        if pool is not None:
            pool.close()
            pool.join()
