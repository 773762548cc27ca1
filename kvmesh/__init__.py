"""kvmesh: a distributed prefix (KV) cache service for LLM serving clusters.

The shared base lives here (page hashing, KV events, config, errors); the
components are `kvmesh.worker`, `kvmesh.coordinator`, `kvmesh.client` and
`kvmesh.proto`.
"""

__version__ = "0.1.0"
