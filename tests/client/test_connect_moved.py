"""`KVMesh.connect`, the old spelling, says where connecting went and starts nothing.

The client imports nothing of the app (tests/test_layering.py), so it cannot
start a cluster; `kvmesh.app.connect` does (pinned by the cluster tests that
use it: tests/integration, tests/security).
"""

from __future__ import annotations

import pytest

from kvmesh.client import KVMesh
from kvmesh.errors import KVMeshError, MovedAPI

ray = pytest.importorskip("ray")


@pytest.mark.parametrize("args", [(), ("auto",), ("127.0.0.1:6379",)])
def test_the_old_connect_names_kvmesh_app_connect_and_attach_and_starts_nothing(
    args: tuple[str, ...],
) -> None:
    was_running = ray.is_initialized()
    with pytest.raises(MovedAPI) as caught:
        KVMesh.connect(*args, num_workers=1)
    message = str(caught.value)
    assert "from kvmesh.app import connect" in message
    assert "KVMesh.attach(address)" in message
    assert isinstance(caught.value, KVMeshError)
    assert ray.is_initialized() == was_running
