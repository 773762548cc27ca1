"""kvmesh's Python API: `KVMesh` (handed a running cluster) and the byte-level tokenizer.

`kvmesh.app.connect()` starts a cluster when needed and returns a `KVMesh`;
`KVMesh.attach(address)` joins one that runs. Importing this package does not
import Ray or torch; connecting does.
"""

from kvmesh.client.mesh import ClusterStats, KVMesh

__all__ = ["ClusterStats", "KVMesh"]
