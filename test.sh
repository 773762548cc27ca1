#!/usr/bin/env bash
# The test command: set up .venv if needed, lint, type-check, run the test suite.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup-venv.sh
scripts/setup-engine-venv.sh  # .venv-engine (vLLM CPU) and .engine-model for tests/engines
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/pytest "$@"
