#!/usr/bin/env bash
# The project's test command: set up when needed (a no-op when all is in place), then pytest.
#   bash scripts/test.sh [pytest args...]     e.g. bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest tests -q -ra --durations=15 "$@"
