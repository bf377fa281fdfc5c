"""What the bad-input tests (tests/bad_input/test_*.py) share: run a console script that must
refuse, and read the one line that says why."""

import pytest

from tests.cli import run_cli


def _failure(name: str, *args, input=None, env=None) -> str:
    """Run console script ``name``, which must fail; run_cli's report (its output's end last)."""
    with pytest.raises(RuntimeError) as failed:
        run_cli(name, *args, input=input, env=env)
    return str(failed.value)


def refusal(name: str, *args, input=None, env=None) -> str:
    """Run console script ``name``, which must fail; its last line of stderr (the error)."""
    return _failure(name, *args, input=input, env=env).rstrip().splitlines()[-1]


def sole_line(name: str, *args, input=None, env=None) -> str:
    """Run console script ``name``, which must fail with one line on stderr and nothing else
    (no traceback above it); that line."""
    stderr = _failure(name, *args, input=input, env=env).split("\n--- stderr ---\n", 1)[1].strip()
    assert len(stderr.splitlines()) == 1, stderr
    return stderr
