"""kvmesh's metrics as named prometheus-client objects, in one place.

Every counter a component bumps is declared here once, with its labels, so
that names follow one convention (``kvmesh_`` prefix, ``_total`` on
counters) and a test can read them with ``REGISTRY.get_sample_value``. A
process outside Ray serves them with prometheus-client's exposition; the
operations work bridges actors' metrics to Ray's metrics endpoint.
"""

from __future__ import annotations

from prometheus_client import Counter

TRANSFER_REFUSED = Counter(
    "kvmesh_transfer_refused",
    "Transfer work a worker refused or cut short, by reason (no grant, hash proof, "
    "pin cap, stream deadline, idle stream, push eviction cap, ...)",
    ["worker", "reason"],
)

REQUESTS_CANCELLED = Counter(
    "kvmesh_requests_cancelled",
    "Requests a worker stopped before answering, by reason: the caller cancelled it "
    "(ray.cancel), its deadline passed, or the caller's process went away",
    ["worker", "reason"],
)
