#!/usr/bin/env bash
# Set up everything this project needs in the current Python environment; safe to repeat.
#
#   bash scripts/setup.sh            # PYTHON=python3.11 bash scripts/setup.sh to choose Python
#
# - torch: an installed torch (e.g. a CUDA build) is kept as it is; only when none is
#   importable is torch==$TORCH_VERSION installed (2.13.0 by default).
# - the dependencies of pyproject.toml, fairseq 0.12.2 without its stale pins (--no-deps),
#   then the named fixes of fairseq_plugins/fairseq_fixes.py, then this plugin (editable).
# - the CUDA kernels, when nvcc and a CUDA build of torch are both present.
# A second run finds everything in place and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check --root-user-action=ignore -q "$@"; }
say() { echo "[setup] $*"; }

"$PYTHON" - <<'PY' || { echo "[setup] Python >= 3.11 is required" >&2; exit 1; }
import sys; sys.exit(sys.version_info < (3, 11))
PY

if "$PYTHON" -c "import torch" 2>/dev/null; then
    say "torch $("$PYTHON" -c 'import torch; print(torch.__version__, "cuda" if torch.version.cuda else "cpu")') kept as installed"
else
    say "installing torch==$TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION"
fi

# Dependencies from pyproject.toml, except torch (kept above) and fairseq (below, --no-deps).
mapfile -t DEPS < <("$PYTHON" scripts/project_dependencies.py --exclude torch fairseq --extra test triton)
missing=$("$PYTHON" scripts/project_dependencies.py --missing --exclude torch fairseq --extra test triton)
if [ -n "$missing" ]; then
    say "installing: $missing"
    pip_install "${DEPS[@]}"
else
    say "dependencies already satisfied"
fi

if [ "$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("fairseq"))' 2>/dev/null)" != "0.12.2" ]; then
    # Built in pip's isolated environment on purpose: without torch there, setup.py skips
    # its C++ extensions, whose sources the 0.12.2 sdist does not ship.
    say "installing fairseq==0.12.2 (builds from source, about 2 minutes)"
    pip_install --no-deps fairseq==0.12.2
else
    say "fairseq 0.12.2 already installed"
fi

"$PYTHON" -m fairseq_plugins.fairseq_fixes apply

if [ "$("$PYTHON" scripts/project_dependencies.py --plugin-location 2>/dev/null)" != "$PWD/fairseq_plugins" ]; then
    say "installing this plugin in editable mode"
    pip_install --no-deps -e .
else
    say "plugin already installed (editable) from $PWD"
fi

if [ -f scripts/build_cuda_ext.py ]; then
    "$PYTHON" scripts/build_cuda_ext.py
fi

"$PYTHON" -m fairseq_plugins.fairseq_fixes check >/dev/null
say "done: fairseq $("$PYTHON" -c 'import fairseq; print(fairseq.__version__)' 2>/dev/null) with fixes, plugin at $PWD/fairseq_plugins"
