"""Every table row resolves to the experiment recorded in tests/fixtures/tables/resolved.json: a
config refactor changes nothing it does not mean to. A deliberate change rewrites the file
(python -m tests.tables_golden --write) in the same commit, with the reason in the message."""

import json

from tests.tables_golden import GOLDEN, resolve_all


def test_every_row_resolves_to_its_recorded_experiment():
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    resolved = json.loads(json.dumps(resolve_all()))  # the JSON round trip the file went through
    assert sorted(resolved) == sorted(golden), "rows added or removed"
    changed = [key for key in golden if resolved[key] != golden[key]]
    assert not changed, f"{len(changed)} rows resolve differently, first: {changed[0]}:\n" \
        f"  recorded {golden[changed[0]]}\n  resolved {resolved[changed[0]]}"
