"""The app: what wires every component into one process.

The `kvmesh` command (`cli`, `commands`), the demo, the offline simulator and
the embedded-cluster launcher live here, above the components they wire
together. Nothing below (the base `kvmesh.*`, client, coordinator, worker,
gateway) imports from this package.
"""
