"""kvmesh: a distributed prefix (KV) cache service for LLM serving clusters.

The shared base lives here (page hashing, KV events, config, errors, request
types, the engines' event subscriber); the components are `kvmesh.worker`,
`kvmesh.coordinator`, `kvmesh.client`, `kvmesh.gateway` and `kvmesh.connector`,
which meet only here and in `kvmesh.proto` (the gateway also builds on the
coordinator's index and policies); `kvmesh.app` (the CLI, the demo,
the simulator, `kvmesh.app.connect`) sits above them all. The base imports
none of them (tests/test_layering.py).
"""

__version__ = "0.1.0"
