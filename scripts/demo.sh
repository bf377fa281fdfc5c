#!/usr/bin/env bash
# The demo in one command, set-up included; options: fairseq-plugins-demo --help (e.g. --minutes 60 --gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m fairseq_plugins.recipes.demo "$@"
