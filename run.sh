#!/usr/bin/env bash
# The main job: set up .venv if needed, then run the kvmesh demo (embedded cluster).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup-venv.sh
exec .venv/bin/kvmesh demo "$@"
