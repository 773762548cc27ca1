#!/usr/bin/env bash
# Creates or refreshes .venv with torch and kvmesh (editable, with dev tools).
# Idempotent: a second run with nothing changed installs nothing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "kvmesh: creating .venv" >&2
  "$py" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "kvmesh: installing torch (CUDA build)" >&2
    .venv/bin/pip install -q torch
  else
    echo "kvmesh: installing torch==2.13.0 (CPU build)" >&2
    .venv/bin/pip install -q torch==2.13.0
  fi
fi
stamp=".venv/.kvmesh-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! .venv/bin/python -c "import kvmesh" >/dev/null 2>&1; then
  echo "kvmesh: installing kvmesh and its dependencies into .venv" >&2
  .venv/bin/pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
