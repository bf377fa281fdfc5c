"""Shared fixtures, computed once per test session (per worker under pytest-xdist): a tiny
binarized En-De corpus, the enwik8 fixture and the tiny language models trained on it; and
which tests pytest-xdist keeps together."""

import os

import pytest
import torch

# Without a GPU, Triton kernels run on the CPU through its interpreter (read when the kernels
# are defined, so before any test imports them): tests/graph_attention/test_triton_backend.py
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# In-process tests call fairseq's parsers with --user-dir, which fairseq skips once any
# fairseq_plugins module is imported (as most tests do): register everything up front.
import fairseq_plugins.models  # noqa: F401
import fairseq_plugins.tasks  # noqa: F401
from fairseq_plugins.command_line import MissingExtra
from tests.cli import tiny_translation_data
from tests.lm_fixture import prepare_enwik8, train_lm

pytest_plugins = ["tests.markers"]  # the cli and gpu marks


@pytest.fixture(scope="session")
def tiny_data_bin(tmp_path_factory):
    """fairseq-preprocess output for ~200 short multi30k pairs (word level, tiny vocab)."""
    return tiny_translation_data(tmp_path_factory.mktemp("tiny-en-de"))


@pytest.fixture(scope="session")
def enwik8_bin(tmp_path_factory):
    """The enwik8 fixture at character level (tests/lm_fixture.py)."""
    return prepare_enwik8(tmp_path_factory.mktemp("enwik8") / "data-bin")


@pytest.fixture(scope="session")
def tiny_lm(enwik8_bin, tmp_path_factory):
    """arch -> the save folder of that tiny language model trained on ``enwik8_bin``: each
    trained once, shared by the tests that read its checkpoint (none writes to the folder)."""
    saved = {}

    def trained(arch: str):
        if arch not in saved:
            saved[arch] = train_lm(enwik8_bin, tmp_path_factory.mktemp(arch) / "ckpt", arch)
        return saved[arch]
    return trained


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the marks (its --dist loadgroup)
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (scripts/test.sh), each module's tests that use a module- or
    class-scoped fixture (often a fairseq-train run) go to one worker, which computes it once:
    spread over workers, every worker would compute it again. The other tests are spread."""
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures is None:  # not a Python test function
            continue
        shared = any(defs[-1].scope in ("class", "module", "package") for defs in fixtures.name2fixturedefs.values())
        if shared and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that reaches a feature whose optional extra is not installed (the plugin raises
    MissingExtra, naming the extra) is reported as skipped with that message, not failed."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and call.excinfo.errisinstance(MissingExtra):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value}")
