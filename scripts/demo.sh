#!/usr/bin/env bash
# The demo in one command; see scripts/demo.py for options (e.g. --minutes 60 --gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python -m scripts.demo "$@"
