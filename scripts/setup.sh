#!/usr/bin/env bash
# Set up everything this project needs in the current Python environment; safe to repeat.
#
#   bash scripts/setup.sh            # PYTHON=python3.11 bash scripts/setup.sh to choose Python
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh   # a CPU-only torch
#
# - torch: an installed torch (e.g. a CUDA build) is kept as it is (one line says when it is
#   outside the range that pyproject.toml declares tested); only when none is
#   importable is torch==$TORCH_VERSION installed (2.14.1 by default, the newest tested), from
#   $TORCH_INDEX_URL when set, else from PyPI (on Linux its CUDA 13.0 build, several GB with
#   its CUDA libraries, GPU or not; the CPU index above serves the CPU build).
# - the dependencies of pyproject.toml and of its extras $EXTRAS ("test lint tensorboard zh tagging plots").
# - triton: the one the installed torch pins (CUDA builds), else $TRITON_VERSION (3.8.0, the pin of
#   torch 2.14's CUDA wheels), so that CPU tests check the Triton that GPU users run.
# - fairseq 0.12.2 built from its sdist with the fixes of fairseq_plugins/fairseq_fixes.py
#   (fairseq_plugins/fairseq_build.py; built once per machine, then cached), installed by pip.
# - this plugin (editable), and the compiled kernels this machine can build (the CPU kernel; the
#   CUDA kernels when nvcc and a CUDA build of torch are present).
# Each step prints a line when it starts and its time when it ends, and a line every 30 s while
# it runs. Nothing installed is ever edited in place; a read-only environment is refused before
# any change. A second run finds everything in place and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.14.1}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
EXTRAS=${EXTRAS:-test lint tensorboard zh tagging plots}
TRITON_VERSION=${TRITON_VERSION:-3.8.0}  # the triton that torch 2.14's CUDA wheels pin; "none": no triton
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check --root-user-action=ignore -q "$@"; }
# say MESSAGE; step WHAT COMMAND...: the set-up's lines, and its progress lines while COMMAND runs
. scripts/setup_progress.sh
require_writable() {  # called before each install: a shared or read-only environment is left alone
    "$PYTHON" - <<'PY' && return
import os, sys, sysconfig; sys.exit(not os.access(sysconfig.get_paths()["purelib"], os.W_OK))
PY
    echo "[setup] $("$PYTHON" -c 'import sys; print(sys.prefix)') is not writable (shared or read-only);" \
        "create your own environment: python -m venv --system-site-packages .venv && . .venv/bin/activate" >&2
    exit 1
}

"$PYTHON" - <<'PY' || { echo "[setup] Python >= 3.11 is required" >&2; exit 1; }
import sys; sys.exit(sys.version_info < (3, 11))
PY

if "$PYTHON" -c "import torch" 2>/dev/null; then
    say "torch $("$PYTHON" -c 'import torch; print(torch.__version__, "cuda" if torch.version.cuda else "cpu")') kept as installed"
    untested=$("$PYTHON" scripts/project_dependencies.py --missing | grep -o 'torch[^ ]*' || true)
    [ -z "$untested" ] || say "  outside this plugin's tested range ($untested; docs/tested_setups.md): kept all the same"
else
    require_writable
    step "installing torch==$TORCH_VERSION from ${TORCH_INDEX_URL:-PyPI}" \
        pip_install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
fi

# Dependencies from pyproject.toml, except torch (kept above) and fairseq (built below).
# shellcheck disable=SC2086  # $EXTRAS is a list of names
mapfile -t DEPS < <("$PYTHON" scripts/project_dependencies.py --exclude torch fairseq --extra $EXTRAS)
# shellcheck disable=SC2086
missing=$("$PYTHON" scripts/project_dependencies.py --missing --exclude torch fairseq --extra $EXTRAS)
if [ -n "$missing" ]; then
    require_writable
    step "installing: $missing" pip_install "${DEPS[@]}"
else
    say "dependencies already satisfied"
fi

# Triton (the "triton" backend; on CPU its tests run the interpreter and compile for sm_80/sm_90a):
# a triton pinned by the installed torch is never replaced; with a CPU torch, TRITON_VERSION.
if [ "$TRITON_VERSION" != none ]; then
    triton=$("$PYTHON" scripts/project_dependencies.py --triton "$TRITON_VERSION")
    if [ -n "$triton" ]; then
        require_writable
        step "installing $triton" pip_install "$triton" ||
            say "could not install $triton: the triton backend and its tests are skipped"
    else
        say "triton $("$PYTHON" -c 'import importlib.metadata as m; print(m.version("triton"))') kept as installed"
    fi
fi

install_fairseq() {  # (inside `step`, so set -e is off: each failure returns)
    local wheel
    wheel=$("$PYTHON" -m fairseq_plugins.fairseq_build) || return
    say "  from $wheel"
    pip_install "$wheel"
}
FAIRSEQ_VERSION=$("$PYTHON" -m fairseq_plugins.fairseq_fixes version)
if [ "$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("fairseq"))' 2>/dev/null)" != "$FAIRSEQ_VERSION" ]; then
    require_writable
    step "installing fairseq $FAIRSEQ_VERSION (built once per machine, then cached)" install_fairseq
else
    say "fairseq $FAIRSEQ_VERSION already installed"
fi

if ! "$PYTHON" scripts/project_dependencies.py --plugin-current "$PWD/fairseq_plugins" 2>/dev/null; then
    require_writable
    # --no-deps: its dependencies are in place (above), and pip must not swap a kept torch
    step "installing this plugin in editable mode" pip_install --no-deps -e .
else
    say "plugin already installed (editable) from $PWD"
fi

# the compiled kernels this machine can build (fairseq-plugins-build-kernels): never fatal,
# the models run on the other backends without them
kernels_started=$SECONDS
"$PYTHON" -m fairseq_plugins.graph_attention.build_kernels ||
    say "a kernel failed to build (its compiler output is above); the other backends run instead"
say "kernels: $((SECONDS - kernels_started)) s"

"$PYTHON" -m fairseq_plugins.fairseq_fixes check >/dev/null
fairseq=$("$PYTHON" -c 'import fairseq; print(fairseq.__version__)')
say "done in $SECONDS s: fairseq $fairseq with fixes, plugin at $PWD/fairseq_plugins"
