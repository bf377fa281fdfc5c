"""`scripts/test.sh` runs pytest-xdist with `--dist loadgroup`: the tests that share a
module-scoped fixture (grouped by tests/conftest.py) or an explicit `xdist_group` go to one
worker, which computes the fixture once. The grouping fails silently where pytest-xdist and
pytest disagree on node ids (pytest 9.2 with pytest-xdist 3.8: pytest-dev/pytest-xdist#1386,
hence the `pytest<9.2` of the test extra): the suite then computes its slowest fixtures twice."""

import os
import subprocess
import sys

from tests.cli import REPO

GROUPED = """
import os
import pytest

pytestmark = {mark}


@pytest.fixture(scope={scope!r})
def shared():
    with open({log!r}, "a") as log:
        log.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")


@pytest.mark.parametrize("i", range(8))
def test_uses_the_fixture(shared, i):
    pass
"""

SPREAD = """
import pytest


@pytest.mark.parametrize("i", range(8))
def test_independent(i):
    pass
"""


def test_a_shared_fixture_is_computed_by_one_worker(tmp_path):
    cases = {"module": ("module", "[]"), "session": ("session", "pytest.mark.xdist_group('compile')")}
    for name, (scope, mark) in cases.items():
        log = tmp_path / f"{name}.log"
        (tmp_path / f"test_{name}.py").write_text(GROUPED.format(mark=mark, scope=scope, log=str(log)))
    (tmp_path / "test_spread.py").write_text(SPREAD)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", "-n", "2",
                           "--dist", "loadgroup", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert "24 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in cases:
        workers = (tmp_path / f"{name}.log").read_text().split()
        assert len(workers) == 1, f"the {name}-scoped fixture was computed by {workers}"
