"""The app: what wires every component into one process.

The `kvmesh` command (`cli`, `commands`), the demo, the offline simulator and
the embedded-cluster launcher live here, above the components they wire
together. Nothing below (the base `kvmesh.*`, client, coordinator, worker,
gateway) imports from this package.

`connect`, the Python API's way in, is here because it may start a cluster
(Ray, the coordinator, the workers)::

    from kvmesh.app import connect

    with connect() as mesh:  # a `kvmesh.client.KVMesh`
        mesh.generate("Hello", max_tokens=8)

It is `kvmesh.app.embedded.connect`, imported on first use: the `kvmesh`
command imports this package and must not pay for Ray and torch to print its
help.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.app.embedded import connect


def __getattr__(name: str) -> Any:
    if name == "connect":
        from kvmesh.app.embedded import connect

        return connect
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["connect"]
