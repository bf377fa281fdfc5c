"""Compiled graph-attention kernels: built once per content and machine into a shared cache,
and loaded at most once per process (a failure is remembered and raised again, never retried).

Shared by the compiled backends (``cuda_backend``, ``cpu_backend``): each describes its build
with an ``Extension`` and loads it from its ``prepare`` (registry), never from a check of
whether it could run. A build lives in ``$FAIRSEQ_PLUGINS_CACHE`` (default
``~/.cache/fairseq_plugins``)``/<folder>/<tag>-<key>/``; the key hashes what the binary depends
on: the sources' names and contents, the compiler flags, the torch build, the Python ABI and the
build's target (the CUDA architectures), never a checkout's path, so any number of clones,
installs and venvs with the same sources share one build (``key.json`` there lists what was
hashed). The folder holds ``<name>.so``, put there by an atomic rename once it was built and
imported, so its presence means built: a later process imports it directly, without a lock,
a compiler or ``ninja`` (a read-only cache works). A ``.so`` that does not import (a corrupt
file) is rebuilt, with one line saying so.

Building takes an advisory ``flock`` on ``build.flock`` (the kernel drops it when its holder
dies, so a killed build blocks nobody), which records the holder's pid and command for those
waiting, who say whom they wait for. The compilation runs torch's
``torch.utils.cpp_extension.load`` in a child process, in ``build/`` emptied first: a fresh
folder, so neither a lock file left there by an older torch nor ``ninja``'s log of earlier
builds (whose command hashes differ between ninja versions) can make it wait or recompile.
The child runs the ``ninja`` of this Python's environment (the ``ninja`` package) whatever
``PATH`` says, and prints a line at the start and one every ``PROGRESS_SECONDS``.
"""

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

try:
    import fcntl
except ImportError:  # Windows: no lock (one build at a time is the user's care)
    fcntl = None

from ..resources import cache_root

#: how often a build, or a process waiting for another one's build, says it is still at it
PROGRESS_SECONDS = 30.0
LIBRARY_SUFFIX = ".pyd" if os.name == "nt" else ".so"  # what torch's build names the module
# the child process that compiles: torch's own build, with the arguments as JSON, and the CUDA
# toolkit that the parent chose (``cuda_toolkit.prepare_build`` sets CUDA_HOME; torch reads it
# only when it was built with CUDA); its error in one line after the compiler's output
BUILD_PROGRAM = """\
import json, os, sys
from torch.utils import cpp_extension
cpp_extension.CUDA_HOME = os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME
try:
    cpp_extension.load(**json.loads(sys.argv[1]))
except Exception as error:
    sys.exit(f"{type(error).__name__}: {error}")
"""


def say(message: str) -> None:
    """One line on stderr: a build takes minutes, whatever the caller's logging shows."""
    print(f"[kernels] {message}", file=sys.stderr, flush=True)


def ninja_directory() -> Path:
    """The folder of the ``ninja`` every build runs: the ``ninja`` package's of the running
    Python, else the first on ``PATH``; raises naming the fix when there is none."""
    try:
        import ninja

        if ninja.BIN_DIR and (Path(ninja.BIN_DIR) / "ninja").is_file():  # "" when it has no binary
            return Path(ninja.BIN_DIR)
    except ImportError:
        pass
    found = shutil.which("ninja")
    if found is None:
        raise RuntimeError(f"ninja not found: {sys.executable} -m pip install ninja")
    return Path(found).parent


def _holder(lock_file: Path) -> str:
    """Who holds a build lock, as its holder recorded it."""
    try:
        record = json.loads(lock_file.read_text())
        return (f"pid {record['pid']} ({record['command']}), building for "
                f"{time.time() - record['since']:.0f} s")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@contextmanager
def build_lock(directory: Path, what: str, poll_seconds: float = 0.5) -> Iterator[None]:
    """Hold ``directory/build.flock`` across processes, recording this process in it; while
    another process holds it, say who it is every ``PROGRESS_SECONDS``."""
    if fcntl is None:
        yield
        return
    lock_file = directory / "build.flock"
    with open(lock_file, "a+") as handle:
        started, last_report = time.monotonic(), None
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if last_report is None or now - last_report >= PROGRESS_SECONDS:
                    say(f"{what}: waiting ({now - started:.0f} s so far) for {_holder(lock_file)} "
                        f"in {directory}")
                    last_report = now
                time.sleep(poll_seconds)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps({"pid": os.getpid(), "command": " ".join(sys.argv)[:200] or sys.executable,
                                     "since": time.time()}))
            handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def import_library(name: str, library: Path):
    """Import a built extension module from its file (raises ImportError when it does not load)."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Extension:
    """One compiled extension, loaded at most once per process (thread-safe)."""

    def __init__(self, name: str, folder: str, tag: str, sources: Sequence[Path],
                 cflags: Sequence[str] = (), cuda_cflags: Sequence[str] = (),
                 include_dirs: Sequence[Path] = (), ldflags: Sequence[str] = (),
                 requirement: Callable[[], Optional[str]] = lambda: None,
                 target: Callable[[], Dict[str, str]] = dict):
        """``sources`` are compiled; every file of ``include_dirs`` is copied beside them (the
        headers they include). ``requirement()`` returns why the extension cannot be built
        here, or None. ``target()``: environment variables that choose what the build targets
        (the CUDA architectures), part of the key."""
        self.name, self.folder, self.tag = name, folder, tag.replace("+", "_")
        self.sources, self.cflags, self.cuda_cflags = tuple(sources), cflags, cuda_cflags
        self.include_dirs, self.ldflags = include_dirs, ldflags
        self.requirement, self.target = requirement, target
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

    def key_inputs(self, target: Dict[str, str]) -> Dict[str, object]:
        """Everything the binary depends on (missing source files hash as empty)."""
        return {
            "name": self.name,
            "sources": {name: hashlib.sha256(path.read_bytes() if path.is_file() else b"").hexdigest()
                        for name, path in sorted(self.files().items())},
            "compiled": [s.name for s in self.sources], "headers_copied": bool(self.include_dirs),
            "cflags": list(self.cflags), "cuda_cflags": list(self.cuda_cflags), "ldflags": list(self.ldflags),
            "target": dict(sorted(target.items())),
            "torch": [torch.__version__, torch.version.git_version, torch.version.cuda],
            "python": sys.implementation.cache_tag,
        }

    def build_directory(self, target: Optional[Dict[str, str]] = None) -> Path:
        """This build's folder in the cache, for ``target`` (default: ``self.target()``)."""
        inputs = self.key_inputs(self.target() if target is None else target)
        key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]
        return cache_root() / self.folder / f"{self.tag}-{key}"

    def load(self, verbose: bool = False):
        """Load the cached module, building it first when needed (minutes); raises on failure,
        and the same error again on every later call (a broken toolchain is not retried)."""
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
        target = self.target()
        directory = self.build_directory(target)
        library = directory / f"{self.name}{LIBRARY_SUFFIX}"
        if library.is_file():  # built: no lock, no compiler (the cache may be read-only)
            try:
                return import_library(self.name, library)
            except ImportError:
                pass  # rebuilt below, under the lock (which tells whether another process is at it)
        problem = _unwritable(directory)
        if problem is not None:
            raise RuntimeError(f"{self.name}: not built, and {directory} {problem}; set FAIRSEQ_PLUGINS_CACHE "
                               "to a writable folder")
        with build_lock(directory, self.name):
            if library.is_file():  # the one checked above, or built by the process waited for
                try:
                    return import_library(self.name, library)
                except ImportError as error:
                    say(f"{self.name}: {library} does not load ({str(error).splitlines()[0]}): rebuilding it")
                    library.unlink()
            self._compile(directory, target, verbose)
            return import_library(self.name, library)

    def _compile(self, directory: Path, target: Dict[str, str], verbose: bool) -> None:
        """Compile into ``directory/build`` in a child process, then move the module beside it."""
        work = directory / "build"
        shutil.rmtree(work, ignore_errors=True)
        copies = work / "src"
        copies.mkdir(parents=True)
        for name, path in self.files().items():
            shutil.copyfile(path, copies / name)
        (directory / "key.json").write_text(json.dumps(self.key_inputs(target), indent=1) + "\n")
        arguments = dict(name=self.name, sources=[str(copies / s.name) for s in self.sources],
                         extra_cflags=list(self.cflags), extra_cuda_cflags=list(self.cuda_cflags),
                         extra_ldflags=list(self.ldflags),
                         extra_include_paths=[str(copies)] if self.include_dirs else [],
                         build_directory=str(work), verbose=True)
        ninja = ninja_directory()
        environment = {**os.environ, **target, "PATH": os.pathsep.join([str(ninja), os.environ.get("PATH", "")])}
        chosen = "".join(f" for {k}={v}" for k, v in sorted(target.items()))
        say(f"{self.name}: compiling into {directory}{chosen} (ninja of {ninja}); minutes, once per "
            "machine and kernel version ...")
        started = time.monotonic()
        output, failed = _run_reporting(self.name, [sys.executable, "-c", BUILD_PROGRAM, json.dumps(arguments)],
                                        environment, verbose)
        seconds = time.monotonic() - started
        (work / "build.log").write_text("".join(line + "\n" for line in output))
        if failed:
            tail = "\n".join(output[-20:])
            raise RuntimeError(f"{self.name}: the build failed after {seconds:.0f} s (the whole log: "
                               f"{work / 'build.log'}):\n{tail}")
        os.replace(work / f"{self.name}{LIBRARY_SUFFIX}", directory / f"{self.name}{LIBRARY_SUFFIX}")
        say(f"{self.name}: built in {seconds:.0f} s")


def _unwritable(directory: Path) -> Optional[str]:
    """Why a build cannot be written into ``directory`` (created if missing), or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot be created ({error.strerror})"
    return None if os.access(directory, os.W_OK) else "is not writable"


def _run_reporting(what: str, command: List[str], environment: Dict[str, str],
                   verbose: bool) -> Tuple[List[str], bool]:
    """Run a build, saying every ``PROGRESS_SECONDS`` how far ninja is; returns its output
    lines (echoed as they come when ``verbose``) and whether it failed."""
    lines: List[str] = []
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace")

    def read():
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if verbose:
                print(line, end="", file=sys.stderr, flush=True)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started = time.monotonic()
    while True:
        try:
            process.wait(timeout=PROGRESS_SECONDS)
            break
        except subprocess.TimeoutExpired:
            steps = [m for m in map(re.compile(r"^\[(\d+)/(\d+)\]").match, list(lines)) if m]
            step = f", {steps[-1][1]} of {steps[-1][2]} steps done" if steps else ""
            say(f"{what}: still compiling ({time.monotonic() - started:.0f} s so far{step})")
    reader.join()
    return lines, process.returncode != 0
