"""The compiled kernels' build lock: a killed build must not make every later load hang."""

import fcntl
import logging
import threading
import time

import pytest

from fairseq_plugins.graph_attention import extension_build
from fairseq_plugins.graph_attention.extension_build import Extension, build_lock


def _extension(tmp_path, monkeypatch):
    monkeypatch.setenv("FAIRSEQ_PLUGINS_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "kernel.cpp"
    source.write_text("")
    return Extension("test_ext", "test_ext", "tag", (source,))


def test_a_lock_left_by_a_killed_build_is_removed_before_torch_sees_it(tmp_path, monkeypatch, caplog):
    extension = _extension(tmp_path, monkeypatch)
    directory = extension.build_directory()
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")  # what torch's FileBaton leaves when its build is killed

    def load(build_directory, **_):
        # torch would wait while this file exists: forever, as nobody is building
        assert not (directory / "lock").exists()
        assert build_directory == str(directory)
        return "module"
    monkeypatch.setattr(extension_build.cpp_extension, "load", load)
    with caplog.at_level(logging.WARNING, logger=extension_build.__name__):
        assert extension.load() == "module"
    assert "left by a build that was killed" in caplog.text


def test_a_live_build_in_another_process_is_waited_for_and_named(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(extension_build, "WAIT_REPORT_SECONDS", 0.2)
    holder = open(tmp_path / "build.flock", "a+")  # another open file: flock conflicts as across processes
    fcntl.flock(holder, fcntl.LOCK_EX)
    (tmp_path / "lock").write_text("")  # the live builder's own torch lock: not stale

    def finish_the_build():
        time.sleep(0.6)
        (tmp_path / "lock").unlink()
        fcntl.flock(holder, fcntl.LOCK_UN)
    builder = threading.Thread(target=finish_the_build)
    builder.start()
    entered = []
    with caplog.at_level(logging.WARNING, logger=extension_build.__name__):
        with build_lock(tmp_path, "test_ext", poll_seconds=0.05):
            entered.append(time.monotonic())
    builder.join()
    holder.close()
    assert entered
    assert "waiting" in caplog.text and str(tmp_path) in caplog.text
    assert "killed" not in caplog.text  # the live build's lock file was left to it


def test_a_short_wait_says_nothing(tmp_path, caplog):
    """Processes started together (parallel test workers, several trainings) wait for each
    other's load of the built kernel, about a second: no warning for that."""
    holder = open(tmp_path / "build.flock", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX)
    releaser = threading.Timer(0.3, fcntl.flock, (holder, fcntl.LOCK_UN))
    releaser.start()
    with caplog.at_level(logging.WARNING, logger=extension_build.__name__):
        started = time.monotonic()
        with build_lock(tmp_path, "test_ext", poll_seconds=0.05):
            waited = time.monotonic() - started
    releaser.join()
    holder.close()
    assert waited >= 0.2  # it did wait for the holder
    assert caplog.text == ""


def test_the_lock_is_released_when_the_build_fails(tmp_path):
    with pytest.raises(RuntimeError, match="compiler exploded"):
        with build_lock(tmp_path, "test_ext"):
            raise RuntimeError("compiler exploded")
    with open(tmp_path / "build.flock", "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if still held


def _recording_load(monkeypatch):
    calls = []

    def load(**kwargs):
        calls.append(kwargs)
        return "module"
    monkeypatch.setattr(extension_build.cpp_extension, "load", load)
    return calls


def _checkout(root, kernel="int f() { return 1; }"):
    (root / "include").mkdir(parents=True)
    (root / "kernel.cpp").write_text(kernel)
    (root / "include" / "kernel.h").write_text("#pragma once\n")
    return root / "kernel.cpp", root / "include"


def test_two_checkouts_of_the_same_sources_share_one_build(tmp_path, monkeypatch):
    """torch's build file names its sources' paths: compiled from each checkout's own path, two
    checkouts would rebuild over each other's build in turn. Both compile the same copies."""
    monkeypatch.setenv("FAIRSEQ_PLUGINS_CACHE", str(tmp_path / "cache"))
    calls = _recording_load(monkeypatch)
    builds = []
    for checkout in ("a", "b"):
        source, include = _checkout(tmp_path / checkout)
        extension = Extension("test_ext", "test_ext", "tag", (source,), include_dirs=(include,))
        assert extension.load() == "module"
        builds.append(extension.build_directory())
    assert builds[0] == builds[1]
    assert calls[0] == calls[1]
    copies = builds[0] / "src"
    assert calls[0]["sources"] == [str(copies / "kernel.cpp")] and calls[0]["extra_include_paths"] == [str(copies)]
    assert (copies / "kernel.h").read_text() == "#pragma once\n"


def test_edited_sources_build_in_their_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FAIRSEQ_PLUGINS_CACHE", str(tmp_path / "cache"))
    _recording_load(monkeypatch)
    old = Extension("test_ext", "test_ext", "tag", _checkout(tmp_path / "old")[:1])
    new = Extension("test_ext", "test_ext", "tag", _checkout(tmp_path / "new", "int f() { return 2; }")[:1])
    assert old.build_directory() != new.build_directory()
    new.load()
    assert (new.build_directory() / "src" / "kernel.cpp").read_text() == "int f() { return 2; }"
