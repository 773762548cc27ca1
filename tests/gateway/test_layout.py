"""The gateway is a component beside the client: base and coordinator APIs, never the worker."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import kvmesh.gateway.app, kvmesh.gateway.routing, kvmesh.gateway.tokenizer
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("kvmesh.", "ray", "torch")))))
"""


def test_importing_the_gateway_loads_neither_the_worker_nor_ray() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout
    loaded = json.loads(out)
    assert "kvmesh.gateway.app" in loaded
    assert not [m for m in loaded if m.startswith(("kvmesh.worker", "kvmesh.client", "ray"))]
