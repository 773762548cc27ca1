#!/usr/bin/env bash
# The test command: set up .venv if needed, lint, type-check, run the test suite.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup-venv.sh
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/pytest "$@"
