# Sourced by scripts/setup.sh: its output lines, and the progress of its long steps (pip
# installs, fairseq's build), which otherwise print nothing for minutes.
PROGRESS_SECONDS=${PROGRESS_SECONDS:-30}

say() { echo "[setup] $*"; }

# step WHAT COMMAND...: say WHAT, run COMMAND saying every PROGRESS_SECONDS how long it has been
# running, then say its time; returns COMMAND's exit status.
step() {
    local what=$1 started=$SECONDS ticker code=0
    shift
    say "$what"
    # sleep gets no stdout/stderr: killed, the ticker must not leave a reader of this output waiting
    ( while sleep "$PROGRESS_SECONDS" >/dev/null 2>&1; do say "  ... $((SECONDS - started)) s so far"; done ) &
    ticker=$!
    "$@" || code=$?
    kill "$ticker" 2>/dev/null && wait "$ticker" 2>/dev/null || true
    if [ "$code" = 0 ]; then say "  done in $((SECONDS - started)) s"; else say "  failed after $((SECONDS - started)) s"; fi
    return "$code"
}
