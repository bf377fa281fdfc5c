"""Compiled graph-attention kernels: where they are cached, built once per process, and
a failure that turns into "not available" (with one warning) instead of an error.

Shared by the compiled backends (``cuda_backend``, ``cpu_backend``): each describes its build
with an ``Extension`` and asks it for the module; the build goes through
``torch.utils.cpp_extension.load`` into ``$FAIRSEQ_PLUGINS_CACHE`` (default
``~/.cache/fairseq_plugins``)``/<folder>/<tag>/``, the tag naming the torch build, so later
processes reuse it and another torch rebuilds.
"""

import logging
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

from torch.utils import cpp_extension

from ..resources import cache_root

logger = logging.getLogger(__name__)


class Extension:
    """One compiled extension, loaded at most once per process (thread-safe)."""

    def __init__(self, name: str, folder: str, tag: str, sources: Sequence[Path],
                 cflags: Sequence[str] = (), cuda_cflags: Sequence[str] = (),
                 include_dirs: Sequence[Path] = (), ldflags: Sequence[str] = (),
                 requirement: Callable[[], Optional[str]] = lambda: None):
        """``requirement()`` returns why the extension cannot be built here, or None."""
        self.name, self.folder, self.tag = name, folder, tag.replace("+", "_")
        self.sources, self.cflags, self.cuda_cflags = tuple(sources), cflags, cuda_cflags
        self.include_dirs, self.ldflags, self.requirement = include_dirs, ldflags, requirement
        self._lock = threading.Lock()
        self._module = None
        self._error: Optional[Exception] = None

    def build_directory(self) -> Path:
        return cache_root() / self.folder / self.tag

    def load(self, verbose: bool = False):
        """Build (first time, minutes) or load the cached module; raises on failure."""
        with self._lock:
            if self._module is None:
                missing = [str(s) for s in self.sources if not s.is_file()]
                if missing:
                    raise RuntimeError(f"{self.name}: sources not found: {missing}")
                reason = self.requirement()
                if reason is not None:
                    raise RuntimeError(f"{self.name}: {reason}")
                directory = self.build_directory()
                directory.mkdir(parents=True, exist_ok=True)
                self._module = cpp_extension.load(
                    name=self.name, sources=[str(s) for s in self.sources],
                    extra_cflags=list(self.cflags), extra_cuda_cflags=list(self.cuda_cflags),
                    extra_ldflags=list(self.ldflags),
                    extra_include_paths=[str(d) for d in self.include_dirs],
                    build_directory=str(directory), verbose=verbose)
        return self._module

    def available(self) -> bool:
        """Whether the module loads (building it if needed); the first failure is logged
        once and remembered, so that a broken toolchain leaves the torch backend in use."""
        if self._error is None and self._module is None:
            try:
                self.load()
            except Exception as error:  # a broken toolchain must not break the torch backend
                self._error = error
                logger.warning("graph attention kernels %s unavailable, using the torch "
                               "backend: %s", self.name, error)
        return self._error is None
