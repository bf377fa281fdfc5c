#!/usr/bin/env bash
# The project's test command: set up when needed (a no-op when all is in place), then pytest.
#   bash scripts/test.sh [pytest args...]     e.g. bash scripts/test.sh -m "not slow and not cli"
#   bash scripts/test.sh tests/graphs tests/install/test_install.py -k wheel  # just those: paths replace `tests`
# tests/ has one folder per layer and family, and the marks slow, cli and gpu (docs/layout.md#tests).
# SETUP=done skips the set-up (.ci/run has already run it, then lint, before the tests).
#
# The tests run in parallel with pytest-xdist (the "test" extra), every worker and the fairseq
# commands it starts on OMP_NUM_THREADS torch threads (1 unless set), and as many workers as
# usable cores / threads (cores: the affinity mask, lowered by a container's CPU quota; 2 on CI),
# so that workers x threads <= cores. Arguments given here come last and win: `-n 1` for fewer
# workers, `-n 0` for none (all in this process). `--dist loadgroup` sends each `xdist_group`
# to one worker: tests/conftest.py groups a module's tests that share a module-scoped fixture
# (often a fairseq-train run), so that it is computed once.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ "${SETUP:-}" != done ]; then
    bash scripts/setup.sh
fi
cores=$("$PYTHON" -c 'from fairseq_plugins.recipes.demo import usable_cores; print(usable_cores())')
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
workers=$(( cores / OMP_NUM_THREADS > 0 ? cores / OMP_NUM_THREADS : 1 ))
echo "[test] $workers workers x $OMP_NUM_THREADS threads on $cores cores"
# An argument naming an existing file or folder (a node id's `::...` stripped) is a test path:
# then pytest gets only the paths given; otherwise it collects all of `tests`.
targets=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        targets=()
        break
    fi
done
exec "$PYTHON" -m pytest "${targets[@]}" -q -ra --durations=15 -n "$workers" --dist loadgroup "$@"
