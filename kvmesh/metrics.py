"""kvmesh's metrics as named prometheus-client objects, in one place.

Every counter a component bumps is declared here once, with its labels, so
that names follow one convention (``kvmesh_`` prefix, ``_total`` on
counters) and a test can read them with ``REGISTRY.get_sample_value``. A
process outside Ray serves them with prometheus-client's exposition; the
operations work bridges actors' metrics to Ray's metrics endpoint.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

TRANSFER_REFUSED = Counter(
    "kvmesh_transfer_refused",
    "Transfer work a worker refused or cut short, by reason (no grant, hash proof, "
    "pin cap, stream deadline, idle stream, push eviction cap, ...)",
    ["worker", "reason"],
)

FETCH_PINNED_PAGES = Gauge(
    "kvmesh_fetch_pinned_pages",
    "Page references FetchPages streams hold on a worker's pool now (capped by "
    "TransferConfig.fetch_pin_fraction of the pool)",
    ["worker"],
)

REQUESTS_CANCELLED = Counter(
    "kvmesh_requests_cancelled",
    "Requests a worker stopped before answering, by reason: the caller cancelled it "
    "(ray.cancel), its deadline passed, or the caller's process went away",
    ["worker", "reason"],
)

PEER_TRANSFERS = Counter(
    "kvmesh_peer_transfers",
    "Pulls and pushes a worker made with a peer, by the transport that carried them (a "
    "torch.distributed transfer that fell back counts under grpc)",
    ["worker", "direction", "transport"],
)
DIST_FALLBACKS = Counter(
    "kvmesh_dist_fallbacks",
    "torch.distributed transfers of a worker that failed and were redone over gRPC",
    ["worker", "direction"],
)
DIST_LINKS = Counter(
    "kvmesh_dist_links",
    "torch.distributed links a worker opened to a peer (client end) or served for one "
    "(server end)",
    ["worker", "end"],
)

# -- the gateway (kvmesh.gateway) in front of real engines; `engine` is the engine's name

GATEWAY_REQUESTS = Counter(
    "kvmesh_gateway_requests",
    "HTTP requests the gateway answered, by endpoint and status code",
    ["endpoint", "status"],
)
GATEWAY_ROUTED = Counter(
    "kvmesh_gateway_routed",
    "Requests sent to an engine, by engine and routing policy",
    ["engine", "policy"],
)
GATEWAY_PROMPT_BLOCKS = Counter(
    "kvmesh_gateway_prompt_blocks",
    "Full prompt blocks of the requests routed to an engine",
    ["engine"],
)
GATEWAY_MATCHED_BLOCKS = Counter(
    "kvmesh_gateway_matched_blocks",
    "Prompt blocks the router expected the chosen engine to hold (its index or history)",
    ["engine"],
)
GATEWAY_RETRIES = Counter(
    "kvmesh_gateway_engine_retries",
    "Requests moved to another engine because this one could not be reached or broke off "
    "before answering, by reason",
    ["engine", "reason"],
)
GATEWAY_ENGINE_DOWN = Counter(
    "kvmesh_gateway_engine_down",
    "Times an engine was marked down (failed /health or a failed request)",
    ["engine"],
)
GATEWAY_ENGINE_UP = Gauge(
    "kvmesh_gateway_engine_up",
    "1 while the gateway routes to the engine, 0 while it is down (read at scrape time)",
    ["engine"],
)
GATEWAY_INFLIGHT = Gauge(
    "kvmesh_gateway_inflight_requests",
    "Requests the gateway has in flight on an engine (read at scrape time)",
    ["engine"],
)
GATEWAY_INFLIGHT_PREFILL = Gauge(
    "kvmesh_gateway_inflight_prefill_tokens",
    "Prompt tokens the gateway expects an engine still to prefill (read at scrape time)",
    ["engine"],
)
GATEWAY_FIRST_BYTE = Histogram(
    "kvmesh_gateway_first_byte_seconds",
    "From sending a request to an engine to its first response bytes",
    ["engine"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)

# Real engines' KV events (coordinator/engine_subscriber.py); `engine` is the
# index worker id (``engine-0``, ``engine-0@dp1`` for a data-parallel rank).
ENGINE_EVENT_BATCHES = Counter(
    "kvmesh_engine_event_batches",
    "Engine KV event batches received, by what the index did with them "
    "(applied, replaced, ignored, held, quarantined)",
    ["engine", "outcome"],
)
ENGINE_BAD_PAYLOADS = Counter(
    "kvmesh_engine_bad_payloads",
    "Engine KV event messages dropped as malformed, by reason (frame, seq, topic, decode, "
    "dp_rank); each one drops the engine's index entries, which a lost batch may have changed",
    ["engine", "reason"],
)
ENGINE_EVENT_GAPS = Counter(
    "kvmesh_engine_event_gaps",
    "Gaps in an engine's event sequence, by outcome: healed from its replay socket, or "
    "uncovered (its index entries dropped, then followed afresh)",
    ["engine", "outcome"],
)
ENGINE_RESTARTS = Counter(
    "kvmesh_engine_restarts",
    "Engine restarts seen in its event sequence (seq back to 0): each starts a new incarnation",
    ["engine"],
)
ENGINE_CANARY = Counter(
    "kvmesh_engine_canary",
    "Hash-parity canary runs by outcome (passed, mismatch, timeout)",
    ["engine", "outcome"],
)
REPLICA_FAILOVERS = Counter(
    "kvmesh_router_failovers",
    "A router replica's calls that went to another replica, by reason: hedged (its own "
    "shard was slow or failed), shard_failed (a replica's shard failed a route), "
    "replica_down (a replica was skipped for state changes)",
    ["reason"],
)


def counter_value(name: str, **labels: str) -> int:
    """The value of counter `name` (without ``_total``) for `labels` in this process; 0
    before its first increment."""
    return int(REGISTRY.get_sample_value(f"{name}_total", labels) or 0)
