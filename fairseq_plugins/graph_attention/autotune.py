"""Timing the graph-attention backends, and remembering which one was fastest.

``backend="auto"`` on a GPU picks among the backends that are correct there by measuring
them, not by a fixed order: the op's cost depends on the device, the dtype, the head dim,
the graph's size and whether dropout runs, and no order is right for all of them (a fused
kernel launches few kernels but walks every edge; flex and the torch path pay glue but run
at dense throughput). An ``Autotuner`` times each candidate once per ``TuningKey``, forward
and backward, keeps the times, and answers later calls from memory, then from a JSON file
per device and software versions under the plugin's cache (``resources.cache_root()``), so
a new process does not time again.

Honest timing: one warm-up run first (compiles, builds, allocator growth: excluded), each
timed run synchronized on the device (``device_time``), the median of up to ``repeats``
runs, a time budget per candidate (``budget_s``), and a candidate whose first timed run is
``give_up_ratio`` times slower than the best so far is not run again. A candidate that
raises (out of memory, a launch failure) is recorded with its error and never chosen.
"""

import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Sequence

import torch

import fairseq_plugins
from fairseq_plugins.resources import cache_root

logger = logging.getLogger(__name__)

# Runs one forward and backward of a candidate; the workload is built before.
Run = Callable[[], None]
# (run, device) -> seconds taken by one run, the device's queued work included
Timer = Callable[[Run, torch.device], float]
CACHE_FORMAT = 1


def device_time(run: Run, device: torch.device) -> float:
    """Wall seconds of ``run``, with the device synchronized before and after: what a
    training step pays, kernel launches and host-side glue included (CUDA events would
    leave out the host time between kernels)."""
    _synchronize(device)
    start = time.perf_counter()
    run()
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def size_bucket(num_nodes: int) -> int:
    """The power of two at or above ``num_nodes`` (at least 256): graphs within a factor of
    two of each other share a timing, so a training run over varying lengths times a few
    buckets, not every length."""
    return max(256, 1 << max(0, num_nodes - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class TuningKey:
    """What a timing is valid for."""

    device: str  # device name, e.g. "NVIDIA H100 80GB HBM3"
    dtype: torch.dtype
    rel_dtype: Optional[torch.dtype]  # relative keys' dtype (float32 under autocast), None: none
    head_dim: int
    size_bucket: int  # ``size_bucket`` of the graph's node count
    dropout: bool  # attention dropout on

    def text(self) -> str:
        """The key as it appears in the cache file and the log."""
        rel = "none" if self.rel_dtype is None else _dtype_name(self.rel_dtype)
        return (f"{self.device} / {_dtype_name(self.dtype)} / rel_key {rel} / head dim {self.head_dim} / "
                f"nodes <= {self.size_bucket} / dropout {'on' if self.dropout else 'off'}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def device_name(device: torch.device) -> str:
    """A name that tells devices of different speed apart."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return device.type


def software_versions() -> Dict[str, str]:
    """What a timing depends on besides the device: torch, triton, the plugin (version and a
    digest of the graph-attention sources, so that an edited kernel is timed again)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    return {"torch": torch.__version__, "triton": triton_version,
            "plugin": f"{fairseq_plugins.__version__}+{digest.hexdigest()[:12]}"}


@dataclasses.dataclass
class Timing:
    """The outcome of timing the candidates for one key."""

    times_ms: Dict[str, float]  # median ms per forward + backward
    failed: Dict[str, str]  # candidate -> the error it raised while timed

    def covers(self, names: Iterable[str]) -> bool:
        return all(name in self.times_ms or name in self.failed for name in names)

    def fastest_first(self, names: Iterable[str]) -> list:
        """``names`` that were timed, fastest first."""
        return sorted((n for n in names if n in self.times_ms), key=self.times_ms.__getitem__)

    def summary(self) -> str:
        parts = [f"{name} {ms:.3g} ms" for name, ms in sorted(self.times_ms.items(), key=lambda item: item[1])]
        parts += [f"{name} failed: {error}" for name, error in sorted(self.failed.items())]
        return ", ".join(parts)


class Autotuner:
    """Times candidates per ``TuningKey`` and remembers the result in memory and on disk.

    ``cache_dir`` None: ``cache_root() / "graph_attention"``, read when first needed (so
    ``FAIRSEQ_PLUGINS_CACHE`` set later is honoured); ``timer``: how one run is timed
    (``device_time``; tests pass a fake clock)."""

    def __init__(self, cache_dir=None, timer: Timer = device_time, repeats: int = 5,
                 budget_s: float = 2.0, give_up_ratio: float = 4.0):
        self.cache_dir, self.timer = None if cache_dir is None else Path(cache_dir), timer
        self.repeats, self.budget_s, self.give_up_ratio = repeats, budget_s, give_up_ratio
        self._timings: Dict[TuningKey, Timing] = {}
        self._versions: Optional[Dict[str, str]] = None

    def cache_file(self, device: str) -> Path:
        """The JSON file of ``device``'s timings under the current software versions."""
        if self._versions is None:
            self._versions = software_versions()
        tag = hashlib.sha256(json.dumps([device, self._versions], sort_keys=True).encode()).hexdigest()[:16]
        slug = "".join(c if c.isalnum() else "-" for c in device).strip("-").lower()
        return (self.cache_dir or cache_root() / "graph_attention") / f"autotune-{slug}-{tag}.json"

    def lookup(self, key: TuningKey) -> Optional[Timing]:
        """The timing of ``key`` from memory, else from the disk cache, else None."""
        if key not in self._timings:
            entry = self._read(key.device).get(key.text())
            if entry is None:
                return None
            self._timings[key] = Timing(dict(entry["times_ms"]), dict(entry["failed"]))
            logger.info("graph attention auto uses the timing of an earlier run for %s (%s)",
                        key.text(), self._timings[key].summary())
        return self._timings[key]

    def tune(self, key: TuningKey, candidates: Sequence[str], make_run: Callable[[str], Run],
             device: torch.device, excluded: Optional[Dict[str, str]] = None) -> Timing:
        """Time ``candidates`` (``make_run(name)`` builds the workload and returns the run),
        remember and store the result with ``excluded`` (backends not timed: name -> why),
        log it once."""
        times, failed = {}, dict(excluded or {})
        for name in candidates:
            try:
                times[name] = self._measure(make_run(name), device, min(times.values(), default=math.inf))
            except Exception as error:  # whatever stops it, it is not used for this key
                failed[name] = f"{type(error).__name__}: {error}"
                if device.type == "cuda" and isinstance(error, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
        timing = Timing({name: seconds * 1e3 for name, seconds in times.items()}, failed)
        self._timings[key] = timing
        self._write(key, timing)
        best = timing.fastest_first(candidates)
        logger.info("graph attention auto chose %s for %s (%s)", best[0] if best else "nothing",
                    key.text(), timing.summary())
        return timing

    def _measure(self, run: Run, device: torch.device, best: float) -> float:
        """Median seconds of ``run`` after a warm-up (see the module docstring for the bounds)."""
        run()  # warm-up: compiles and first-use costs are not the op's speed
        times = []
        while len(times) < self.repeats:
            times.append(self.timer(run, device))
            if sum(times) > self.budget_s or times[0] > self.give_up_ratio * best:
                break
        return statistics.median(times)

    def _read(self, device: str) -> dict:
        """The stored timings of ``device`` (key text -> entry); a missing file is empty, an
        unreadable one is ignored with a warning, and so is an entry with a time that is not
        a finite number >= 0 (JSON allows NaN and Infinity: such a time would sort first)."""
        path = self.cache_file(device)
        try:
            data = json.loads(path.read_text())
            if data.get("format") != CACHE_FORMAT or not isinstance(data.get("timings"), dict):
                raise ValueError("not a timing cache of this format")
            for entry in data["timings"].values():
                if not (isinstance(entry["times_ms"], dict) and isinstance(entry["failed"], dict)
                        and all(isinstance(ms, (int, float)) for ms in entry["times_ms"].values())):
                    raise ValueError("an entry without times")
            timings = {}
            for text, entry in data["timings"].items():
                bad = {name: ms for name, ms in entry["times_ms"].items() if not 0 <= ms < math.inf}
                if bad:
                    warnings.warn(f"ignoring the graph attention timing of {text} in {path} (times that are not "
                                  f"finite numbers >= 0: {bad}); the backends are timed again",
                                  RuntimeWarning, stacklevel=4)
                else:
                    timings[text] = entry
            return timings
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            warnings.warn(f"ignoring the graph attention timing cache {path} ({type(error).__name__}: "
                          f"{error}); the backends are timed again", RuntimeWarning, stacklevel=4)
            return {}

    def _write(self, key: TuningKey, timing: Timing) -> None:
        """Add ``key``'s timing to the device's file: written to a temporary file beside it
        and renamed over it, so a reader never sees half a file; a cache that cannot be
        written costs a warning, not the run."""
        path = self.cache_file(key.device)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a corrupt file was warned about when read
                timings = self._read(key.device)
            timings[key.text()] = dataclasses.asdict(timing)
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp",
                                             delete=False) as handle:
                try:
                    json.dump({"format": CACHE_FORMAT, "versions": self._versions, "timings": timings},
                              handle, indent=1, sort_keys=True)
                except BaseException:
                    os.unlink(handle.name)
                    raise
            os.replace(handle.name, path)
        except OSError as error:
            warnings.warn(f"could not store the graph attention timing in {path} ({error})",
                          RuntimeWarning, stacklevel=3)
