"""Compiled graph-attention kernels: where they are cached, and built or loaded at most once
per process (a failure is remembered and raised again, never retried).

Shared by the compiled backends (``cuda_backend``, ``cpu_backend``): each describes its build
with an ``Extension`` and loads it from its ``prepare`` (registry), never from a check of
whether it could run; the build goes through
``torch.utils.cpp_extension.load`` into ``$FAIRSEQ_PLUGINS_CACHE`` (default
``~/.cache/fairseq_plugins``)``/<folder>/<tag>-<digest>/``, the tag naming the torch build and
the digest the sources' contents, so later processes reuse it and another torch or an edited
kernel builds anew. The sources are compiled from a copy inside that folder: torch's build file
names its sources' paths, so two checkouts (or a checkout and an installed wheel) compiling from
their own paths would each see the other's build as stale and rebuild it, in turn, for ever.

torch guards its build directory with a ``lock`` file that a killed build leaves behind, and
every later load then waits on it forever, silently. So processes first take an advisory
``flock`` on ``<tag>/build.flock`` (the kernel drops it when its holder dies): whoever holds it
knows any ``lock`` file is stale and removes it, saying so, and whoever waits longer than
``WAIT_REPORT_SECONDS`` says whom for (loading a built kernel holds the lock about a second,
which processes started together, such as parallel test workers, wait out without a warning).
"""

import hashlib
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Sequence

from torch.utils import cpp_extension

try:
    import fcntl
except ImportError:  # Windows: torch's own lock file only
    fcntl = None

from ..resources import cache_root

logger = logging.getLogger(__name__)

#: after how long, and then how often, a process waiting for another one's build says so
WAIT_REPORT_SECONDS = 30.0


@contextmanager
def build_lock(directory: Path, what: str, poll_seconds: float = 0.5) -> Iterator[None]:
    """Hold ``directory/build.flock`` across processes; inside it, torch's ``lock`` file, if
    any, was left by a dead build and is removed (see the module docstring)."""
    if fcntl is None:
        yield
        return
    with open(directory / "build.flock", "a+") as handle:
        started = last_report = time.monotonic()
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - last_report >= WAIT_REPORT_SECONDS:
                    logger.warning("%s: waiting (%.0f s so far) for another process building or loading it "
                                   "in %s", what, now - started, directory)
                    last_report = now
                time.sleep(poll_seconds)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("%s: removing %s, left by a build that was killed (it would make "
                               "torch wait forever)", what, stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Extension:
    """One compiled extension, loaded at most once per process (thread-safe)."""

    def __init__(self, name: str, folder: str, tag: str, sources: Sequence[Path],
                 cflags: Sequence[str] = (), cuda_cflags: Sequence[str] = (),
                 include_dirs: Sequence[Path] = (), ldflags: Sequence[str] = (),
                 requirement: Callable[[], Optional[str]] = lambda: None):
        """``sources`` are compiled; every file of ``include_dirs`` is copied beside them (the
        headers they include). ``requirement()`` returns why the extension cannot be built
        here, or None."""
        self.name, self.folder = name, folder
        self.sources, self.cflags, self.cuda_cflags = tuple(sources), cflags, cuda_cflags
        self.include_dirs, self.ldflags, self.requirement = include_dirs, ldflags, requirement
        self.tag = f"{tag}-{self.source_digest()}".replace("+", "_")
        self._lock = threading.Lock()
        self._module = None
        self._error: Optional[Exception] = None

    def files(self) -> Dict[str, Path]:
        """What the build reads, by the name it has in the build's source copy."""
        files = {s.name: s for s in self.sources}
        for directory in self.include_dirs:
            for path in sorted(directory.iterdir()) if directory.is_dir() else ():
                if path.is_file() and files.setdefault(path.name, path) != path:
                    raise ValueError(f"{self.name}: two sources named {path.name}: {files[path.name]}, {path}")
        return files

    def source_digest(self) -> str:
        """A short hash of the sources' names and contents (missing files hash as absent)."""
        digest = hashlib.sha1()
        for name, path in sorted(self.files().items()):
            digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
        return digest.hexdigest()[:10]

    def build_directory(self) -> Path:
        return cache_root() / self.folder / self.tag

    def load(self, verbose: bool = False):
        """Build (first time, minutes) or load the cached module; raises on failure, and the
        same error again on every later call (a broken toolchain is not retried)."""
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"{self.name} could not be built or loaded: {self._error}") from self._error
            if self._module is None:
                try:
                    self._module = self._build(verbose)
                except Exception as error:
                    self._error = error
                    raise
        return self._module

    def _build(self, verbose: bool):
        missing = [str(s) for s in self.sources if not s.is_file()]
        if missing:
            raise RuntimeError(f"{self.name}: sources not found: {missing}")
        reason = self.requirement()
        if reason is not None:
            raise RuntimeError(f"{self.name}: {reason}")
        directory = self.build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        with build_lock(directory, self.name):
            copies = directory / "src"
            copies.mkdir(exist_ok=True)
            for name, path in self.files().items():
                _write_if_changed(copies / name, path.read_bytes())
            return cpp_extension.load(
                name=self.name, sources=[str(copies / s.name) for s in self.sources],
                extra_cflags=list(self.cflags), extra_cuda_cflags=list(self.cuda_cflags),
                extra_ldflags=list(self.ldflags),
                extra_include_paths=[str(copies)] if self.include_dirs else [],
                build_directory=str(directory), verbose=verbose)


def _write_if_changed(path: Path, content: bytes) -> None:
    """Leave an identical file untouched (its time stamp is what ninja compares)."""
    if path.is_file() and path.read_bytes() == content:
        return
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    temporary.write_bytes(content)
    temporary.replace(path)
