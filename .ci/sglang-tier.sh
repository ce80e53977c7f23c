#!/usr/bin/env bash
# The SGLang tier: tests/sglang_tier against real SGLang servers on CPU, in its own virtual environment (.venv-sglang).
# See .ci/engine-tier.sh for what it installs and runs; extra arguments go to pytest.
exec bash "$(dirname "$0")/engine-tier.sh" sglang "$@"
