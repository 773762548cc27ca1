"""Where the coordinator still finds the link store it hosts (`host_link_store`).

The torch.distributed transfer code lives in `kvmesh.worker.dist_group`
(process groups, links' store), `kvmesh.worker.dist_wire` (framing) and
`kvmesh.worker.dist_transport` (pull, push, serve); this name stays until
the coordinator imports the store from the base.
"""

from kvmesh.worker.dist_group import host_link_store

__all__ = ["host_link_store"]
