#!/usr/bin/env bash
# The vLLM tier: tests/vllm_tier against real vLLM servers on CPU, in its own virtual environment (.venv-vllm).
# See .ci/engine-tier.sh for what it installs and runs; extra arguments go to pytest.
exec bash "$(dirname "$0")/engine-tier.sh" vllm "$@"
