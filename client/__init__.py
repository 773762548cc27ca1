"""kvmesh's Python API: `KVMesh.connect()` and the byte-level tokenizer.

Importing this package does not import Ray or torch; `KVMesh.connect` does.
"""

from kvmesh.client.mesh import ClusterStats, KVMesh

__all__ = ["ClusterStats", "KVMesh"]
