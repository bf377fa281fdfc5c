"""What the bad-input tests (tests/bad_input/test_*.py) share: run a console script that must
refuse, and read the one line that says why."""

import pytest

from tests.cli import run_cli


def refusal(name: str, *args, input=None, env=None) -> str:
    """Run console script ``name``, which must fail; its last line of stderr (the error)."""
    with pytest.raises(RuntimeError) as failed:
        run_cli(name, *args, input=input, env=env)
    return str(failed.value).rstrip().splitlines()[-1]
