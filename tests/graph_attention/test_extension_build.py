"""The compiled kernels' cache: one build per content and machine, shared by every checkout,
whatever ``ninja`` is on PATH; a killed build, a stale lock file, a read-only cache or a
corrupt library never blocks or breaks a later load.

The builds here are real (torch's build, in the child process ``Extension`` runs) of a tiny
module on Python's C API that compiles in about a second; the compiler is a wrapper that
logs its compile commands, so the tests count compilations.
"""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fairseq_plugins.graph_attention import build_kernels, extension_build
from fairseq_plugins.graph_attention.extension_build import Extension, build_lock
from tests.cli import REPO

TINY_SOURCE = """\
#include <Python.h>
#include "tiny.h"
#define NAME_(name) #name
#define NAME(name) NAME_(name)
#define INIT_(name) PyInit_##name
#define INIT(name) INIT_(name)
static PyModuleDef module = {PyModuleDef_HEAD_INIT, NAME(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""
# a process that loads the tiny extension of the checkout given as its argument
LOAD_PROGRAM = """\
import sys
from pathlib import Path
from fairseq_plugins.graph_attention.extension_build import Extension
root = Path(sys.argv[1])
print(Extension("tiny_ext", "tiny", "tag", (root / "tiny.cpp",), include_dirs=(root / "include",)).load().__file__)
"""


def _checkout(root: Path, value: int = 1) -> Path:
    """The tiny extension's sources, as a checkout at ``root`` holds them."""
    (root / "include").mkdir(parents=True)
    (root / "tiny.cpp").write_text(TINY_SOURCE)
    (root / "include" / "tiny.h").write_text(f"#define TINY_VALUE {value}\n")
    return root


def _tiny(root: Path, name: str = "tiny_ext") -> Extension:
    return Extension(name, "tiny", "tag", (root / "tiny.cpp",), include_dirs=(root / "include",))


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """An empty cache and a compiler that logs its compile commands (``compiles()``)."""
    log = tmp_path / "compiler.log"
    wrapper = tmp_path / "bin" / "counting-c++"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo "$*" >> {log};; esac\n'
                       f'exec "${{REAL_CXX:-c++}}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("FAIRSEQ_PLUGINS_CACHE", str(tmp_path / "cache"))

    def compiles() -> int:
        return len(log.read_text().splitlines()) if log.is_file() else 0
    return compiles


def _load_in_process(checkout: Path, timeout: float = 600, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-c", LOAD_PROGRAM, str(checkout)], env=environment,
                          capture_output=True, text=True, timeout=timeout)


def _fake_ninja_first(tmp_path) -> str:
    """A PATH whose first ``ninja`` fails: a build that ran it would fail."""
    fake = tmp_path / "fake-ninja"
    fake.mkdir()
    (fake / "ninja").write_text("#!/bin/sh\necho 'the wrong ninja' >&2\nexit 1\n")
    (fake / "ninja").chmod(0o755)
    return os.pathsep.join([str(fake), os.environ["PATH"]])


@pytest.mark.slow
def test_two_checkouts_and_two_paths_build_once(tmp_path, counted):
    """Each checkout compiles from its own path; whichever ninja is on PATH, the second
    process compiles nothing and loads the first one's build."""
    first = _load_in_process(_checkout(tmp_path / "clone-a"), PATH=_fake_ninja_first(tmp_path))
    assert first.returncode == 0, first.stderr
    assert counted() == 1 and "compiling into" in first.stderr
    second = _load_in_process(_checkout(tmp_path / "clone-b"), PATH="/usr/bin:/bin:" + os.environ["PATH"])
    assert second.returncode == 0, second.stderr
    assert counted() == 1 and second.stderr == ""
    assert first.stdout == second.stdout  # the same file
    directory = Path(first.stdout.strip()).parent
    assert str(tmp_path / "clone-a") not in (directory / "key.json").read_text()


def test_the_key_is_the_content_never_the_path(tmp_path):
    same = [_tiny(_checkout(tmp_path / name)).build_directory() for name in ("a", "b")]
    assert same[0] == same[1]
    edited = _tiny(_checkout(tmp_path / "edited", value=2))
    assert edited.build_directory() != same[0]  # a header's content counts too
    extension = _tiny(tmp_path / "a")
    flagged = Extension("tiny_ext", "tiny", "tag", extension.sources, cflags=("-O1",),
                        include_dirs=extension.include_dirs)
    assert flagged.build_directory() != same[0]
    assert (extension.build_directory({"TORCH_CUDA_ARCH_LIST": "9.0+PTX"})
            != extension.build_directory({"TORCH_CUDA_ARCH_LIST": "8.0;9.0"}))


@pytest.mark.slow
def test_a_killed_build_leaves_nothing_that_blocks_the_next(tmp_path, counted):
    checkout = _checkout(tmp_path / "clone")
    slow = tmp_path / "bin" / "slow-c++"
    slow.write_text('#!/bin/sh\nsleep 60\nexec c++ "$@"\n')
    slow.chmod(0o755)
    environment = {**os.environ, "PYTHONPATH": str(REPO), "REAL_CXX": str(slow)}
    building = subprocess.Popen([sys.executable, "-c", LOAD_PROGRAM, str(checkout)], env=environment,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    work = _tiny(checkout).build_directory() / "build"
    deadline = time.monotonic() + 120
    while not (work / "lock").exists():  # torch's own lock: the compiler is running
        assert building.poll() is None and time.monotonic() < deadline, building.stderr.read()
        time.sleep(0.2)
    os.killpg(building.pid, signal.SIGKILL)  # the job, its build and its compiler
    building.wait()
    assert (work / "lock").exists()  # what it left
    loaded = _load_in_process(checkout, timeout=90)  # a wait for the dead build would time out
    assert loaded.returncode == 0, loaded.stderr
    assert Path(loaded.stdout.strip()).parent == work.parent and "waiting" not in loaded.stderr


def test_a_stale_torch_lock_file_is_not_reported(tmp_path, counted, capfd):
    """torch 2.14 keeps its ``lock`` file in the build folder; older ones leave it when killed."""
    extension = _tiny(_checkout(tmp_path / "clone"))
    for folder in (extension.build_directory(), extension.build_directory() / "build"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "lock").write_text("")
    extension.load()
    _tiny(tmp_path / "clone").load()  # and a later process's load of that build
    said = [line.split(": ")[1].split()[0] for line in capfd.readouterr().err.splitlines()]
    assert said == ["compiling", "built"]  # and nothing about a lock


@pytest.mark.slow
def test_a_read_only_built_cache_is_used_as_it_is(tmp_path, counted):
    checkout = _checkout(tmp_path / "clone")
    built = _load_in_process(checkout)
    assert built.returncode == 0, built.stderr
    directory = Path(built.stdout.strip()).parent
    (directory / "build.flock").unlink()
    (directory / "build.flock").mkdir()  # cannot be opened, even by root, whom chmod does not stop
    for path in [directory, *directory.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        loaded = _load_in_process(checkout)
    finally:
        for path in [directory, *directory.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
    assert loaded.returncode == 0 and loaded.stdout == built.stdout and loaded.stderr == "", loaded.stderr
    assert counted() == 1


def test_an_unwritable_cache_without_the_build_says_what_to_do(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FAIRSEQ_PLUGINS_CACHE", str(tmp_path / "a-file" / "cache"))
    with pytest.raises(RuntimeError, match=r"tiny_ext: not built, and .* cannot be created .*; set "
                                           "FAIRSEQ_PLUGINS_CACHE to a writable folder"):
        _tiny(_checkout(tmp_path / "clone")).load()


@pytest.mark.slow
def test_a_corrupt_library_is_rebuilt_and_said_so(tmp_path, counted):
    checkout = _checkout(tmp_path / "clone")
    built = _load_in_process(checkout)
    assert built.returncode == 0, built.stderr
    Path(built.stdout.strip()).write_bytes(b"not a shared object")
    rebuilt = _load_in_process(checkout)
    assert rebuilt.returncode == 0 and rebuilt.stdout == built.stdout, rebuilt.stderr
    (said,) = [line for line in rebuilt.stderr.splitlines() if "does not load" in line]
    assert said.endswith(": rebuilding it") and built.stdout.strip() in said
    assert counted() == 2
    again = _load_in_process(checkout)
    assert again.returncode == 0 and again.stderr == "" and counted() == 2


def test_a_build_says_it_started_and_how_far_it_is(tmp_path, counted, monkeypatch, capfd):
    slow = tmp_path / "bin" / "slow-c++"
    slow.write_text('#!/bin/sh\nsleep 1.5\nexec c++ "$@"\n')
    slow.chmod(0o755)
    monkeypatch.setenv("REAL_CXX", str(slow))
    monkeypatch.setattr(extension_build, "PROGRESS_SECONDS", 0.5)
    _tiny(_checkout(tmp_path / "clone"), "tiny_progress").load()
    lines = capfd.readouterr().err.splitlines()
    assert "tiny_progress: compiling into" in lines[0]
    assert any("tiny_progress: still compiling (" in line for line in lines[1:-1])
    assert "tiny_progress: built in" in lines[-1]


def test_a_failed_build_shows_the_compiler_and_is_not_retried(tmp_path, counted):
    checkout = _checkout(tmp_path / "clone")
    (checkout / "tiny.cpp").write_text("this is not C++\n")
    extension = _tiny(checkout)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"(?s)tiny_ext.*the build failed after .* s .*build\.log.*"
                                               "this is not C"):
            extension.load()
    assert counted() == 1
    assert (extension.build_directory() / "build" / "build.log").is_file()


def test_a_waiting_process_says_who_holds_the_lock(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(extension_build, "PROGRESS_SECONDS", 0.2)
    holder = open(tmp_path / "build.flock", "a+")  # another open file: flock conflicts as across processes
    fcntl.flock(holder, fcntl.LOCK_EX)
    holder.write(json.dumps({"pid": 4242, "command": "fairseq-train data-bin", "since": time.time() - 95}))
    holder.flush()
    releaser = threading.Timer(0.7, fcntl.flock, (holder, fcntl.LOCK_UN))
    releaser.start()
    with build_lock(tmp_path, "test_ext", poll_seconds=0.05):
        record = json.loads((tmp_path / "build.flock").read_text())
    releaser.join()
    holder.close()
    waits = [line for line in capfd.readouterr().err.splitlines() if "waiting" in line]
    assert len(waits) >= 2  # at once, then every PROGRESS_SECONDS
    assert "test_ext: waiting (0 s so far) for pid 4242 (fairseq-train data-bin), building for 95 s" in waits[0]
    assert record["pid"] == os.getpid()  # the new holder says who it is


def test_a_lock_whose_holder_died_is_taken_at_once(tmp_path):
    """flock dies with its holder: no stale lock, whatever the file says."""
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print(flush=True); time.sleep(600)",
                               str(tmp_path / "build.flock")], stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    holder.kill()
    holder.wait()
    started = time.monotonic()
    with build_lock(tmp_path, "test_ext"):
        assert time.monotonic() - started < 1


def test_the_lock_is_released_when_the_build_fails(tmp_path):
    with pytest.raises(RuntimeError, match="compiler exploded"):
        with build_lock(tmp_path, "test_ext"):
            raise RuntimeError("compiler exploded")
    with open(tmp_path / "build.flock", "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if still held


def test_without_ninja_the_error_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ninja", None)  # the package is not installed
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"ninja not found: .* -m pip install ninja"):
        extension_build.ninja_directory()


# ------------------------------------------------------------- fairseq-plugins-build-kernels

def test_the_command_says_what_it_built_skipped_and_failed(tmp_path, counted, capfd):
    good = _tiny(_checkout(tmp_path / "good"), "tiny_good")
    broken = _checkout(tmp_path / "broken")
    (broken / "tiny.cpp").write_text("this is not C++\n")
    kernels = {"good": good, "gpu": Extension("tiny_gpu", "tiny", "tag", good.sources,
                                              requirement=lambda: "no GPU toolkit here"),
               "broken": _tiny(broken, "tiny_broken")}
    assert build_kernels.build(kernels) == ["broken"]
    said = {line.split(": ")[0].split()[-1]: line for line in capfd.readouterr().err.splitlines()
            if not line.startswith("[kernels] tiny_")}
    assert said["good"].startswith("[kernels] good: ready in ") and str(good.build_directory()) in said["good"]
    assert said["gpu"] == "[kernels] gpu: skipped, no GPU toolkit here"
    assert said["broken"].startswith("[kernels] broken: FAILED, tiny_broken: the build failed")
    assert counted() == 2
    assert build_kernels.build({"good": _tiny(tmp_path / "good", "tiny_good")}) == []  # built: loaded
    assert counted() == 2


def _copy_of_the_repository(destination: Path) -> Path:
    """A checkout elsewhere: the package and the kernel sources, as they are in this one."""
    for folder in ("fairseq_plugins", "cpu_ext", "cuda_ext"):
        shutil.copytree(REPO / folder, destination / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return destination


@pytest.mark.slow
@pytest.mark.cli
def test_two_clones_build_the_kernels_once(tmp_path, counted):
    """The set-up's command in one clone, a BPT attention on the CPU kernel in another, one
    empty cache: the second compiles nothing (the real CPU kernel: a minute or two). With a CUDA
    torch the CUDA kernels are left out (a toolkit without nvcc): minutes more, another subject."""
    clones = [_copy_of_the_repository(tmp_path / name) for name in ("clone-a", "clone-b")]
    command = [sys.executable, "-m", "fairseq_plugins.graph_attention.build_kernels"]
    no_toolkit = str(tmp_path / "no-cuda-toolkit")
    built = subprocess.run(command, cwd=clones[0], capture_output=True, text=True, timeout=900,
                           env={**os.environ, "PYTHONPATH": str(clones[0]), "CUDA_HOME": no_toolkit})
    assert built.returncode == 0, built.stderr
    assert "[kernels] cpu: ready in" in built.stderr and counted() == 1
    assert "[kernels] cuda: " in built.stderr  # built, or skipped with the reason
    attention = ("import torch\n"
                 "from fairseq_plugins.graph_attention import graph_attention\n"
                 "from fairseq_plugins.graphs.binary_partition import bpt_graph\n"
                 "g = bpt_graph(8, 2)\n"
                 "q = torch.randn(1, 2, g.num_nodes, 16)\n"
                 "print(graph_attention(q, q, q, g, backend='cpu').shape)\n")
    used = subprocess.run([sys.executable, "-c", attention], cwd=clones[1],
                          env={**os.environ, "PYTHONPATH": str(clones[1])}, capture_output=True, text=True,
                          timeout=900)
    assert used.returncode == 0 and used.stderr == "", used.stderr
    assert counted() == 1
