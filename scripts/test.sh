#!/usr/bin/env bash
# The project's test command: set up when needed (a no-op when all is in place), then pytest.
#   bash scripts/test.sh [pytest args...]     e.g. bash scripts/test.sh -m "not slow"
# SETUP=done skips the set-up (.ci/run has already run it, then lint, before the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${SETUP:-}" != done ]; then
    bash scripts/setup.sh
fi
exec "${PYTHON:-python3}" -m pytest tests -q -ra --durations=15 "$@"
