"""Each routing decision beside its outcome: what the router believed, what the engine did.

A benchmark's hit rate says how well a policy did, not why. To tell a
follow-up turn routed away from its prefix by load from one routed on a
prefix that was already gone, each decision is kept with what the router
saw when it made it (every candidate engine's matched blocks and queued
prefill), the blocks it expected the chosen engine to hold, and, once the
engine answered with usage, the prompt blocks it really did not compute
(vLLM's ``prompt_tokens_details.cached_tokens``, given when the engine runs
with ``--enable-prompt-tokens-details`` and, for streams, when the caller
asks for ``stream_options.include_usage``).

`DecisionLog` keeps the last `capacity` records in memory (``GET
/kvmesh/decisions`` lists them; ``x-kvmesh-decision`` names a request's
record). Cost: one small record per request, O(1) to add or complete.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvmesh.errors import ConfigError
from kvmesh.load import WorkerLoad
from kvmesh.types import WorkerId

DECISION_HEADER = "x-kvmesh-decision"


@dataclass(slots=True)
class DecisionRecord:
    """One routing decision; `realized_blocks` stays None until the engine reports usage.

    `overlaps`: blocks the router counted as held, per candidate engine
    (the event-fed index plus prompts being prefilled, or the history
    router's own record; under ``kv_mesh`` the engine's store too).
    `queued_tokens`: each candidate's prefill tokens in flight when the
    decision was made. `stale`: candidates without affinity then.

    Predicted reuse on the chosen engine: `predicted_blocks` from its own
    cache, `store_blocks` loaded from its kvmesh store (``kv_mesh``: held
    there, gone from its cache), `pull_blocks` pulled through the mesh;
    `realized_blocks` is what the engine reports it did not compute, all
    three together (vLLM's ``cached_tokens`` counts its own hits and the
    connector's loads), so ``predicted_total`` is its prediction.
    """

    id: int
    policy: str
    engine: str
    prompt_blocks: int
    predicted_blocks: int
    pull_blocks: int = 0
    overlaps: dict[str, int] = field(default_factory=dict)
    queued_tokens: dict[str, int] = field(default_factory=dict)
    stale: list[str] = field(default_factory=list)
    prefix: str = ""
    """Hex of the prompt's first block hash: requests of one conversation share it."""
    attempt: int = 0
    """0 for the first engine tried; a retry on another engine is a record of its own."""
    realized_blocks: int | None = None
    route_ms: float | None = None
    """From the gateway's start on the request (after reading the body) to this decision:
    hashing and routing, and earlier attempts' time on a retry."""
    first_byte_ms: float | None = None
    """From sending the request to the engine to its first bytes (streams: the first token)."""
    store_blocks: int = 0
    store_overlaps: dict[str, int] = field(default_factory=dict)
    """``kv_mesh``: per candidate, the blocks of its `overlaps` only its store holds."""

    @property
    def predicted_total(self) -> int:
        """Every block the router expected the engine not to compute."""
        return self.predicted_blocks + self.store_blocks + self.pull_blocks

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "predicted_total": self.predicted_total}


class DecisionLog:
    """The last `capacity` decisions by id (0: keep none), oldest dropped first."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 0:
            raise ConfigError(f"the decision log holds >= 0 records, got {capacity}")
        self.capacity = capacity
        self._records: OrderedDict[int, DecisionRecord] = OrderedDict()
        self._next = 0

    def record(
        self,
        *,
        policy: str,
        engine: str,
        prompt_blocks: int,
        predicted_blocks: int,
        pull_blocks: int,
        overlaps: Mapping[WorkerId, int],
        loads: list[WorkerLoad],
        prefix: bytes,
        attempt: int,
        store_blocks: int = 0,
        store_overlaps: Mapping[WorkerId, int] | None = None,
    ) -> int:
        """A new record's id (ids count up from 0 whether or not records are kept)."""
        rid = self._next
        self._next += 1
        if not self.capacity:
            return rid
        self._records[rid] = DecisionRecord(
            rid,
            policy,
            engine,
            prompt_blocks,
            predicted_blocks,
            pull_blocks,
            {str(load.worker_id): overlaps.get(load.worker_id, 0) for load in loads},
            {str(load.worker_id): load.active_prefill_tokens for load in loads},
            sorted(str(load.worker_id) for load in loads if load.stale),
            prefix.hex(),
            attempt,
            store_blocks=store_blocks,
            store_overlaps={
                str(load.worker_id): store_overlaps.get(load.worker_id, 0)
                for load in loads
                if store_overlaps and store_overlaps.get(load.worker_id, 0)
            },
        )
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)
        return rid

    def realize(self, rid: int, cached_blocks: int) -> None:
        """The engine reported `cached_blocks` prompt blocks it did not compute (a gone
        record is ignored: the log moved on)."""
        record = self._records.get(rid)
        if record is not None:
            record.realized_blocks = cached_blocks

    def routed(self, rid: int, seconds: float) -> None:
        record = self._records.get(rid)
        if record is not None:
            record.route_ms = round(seconds * 1000, 3)

    def first_byte(self, rid: int, seconds: float) -> None:
        record = self._records.get(rid)
        if record is not None:
            record.first_byte_ms = round(seconds * 1000, 3)

    def get(self, rid: int) -> DecisionRecord | None:
        return self._records.get(rid)

    def records(self, since: int = 0) -> list[DecisionRecord]:
        """Kept records with id >= `since`, oldest first."""
        return [r for rid, r in self._records.items() if rid >= since]


def cached_tokens(usage: object) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI answer, or None if absent."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    value = details.get("cached_tokens")
    return value if isinstance(value, int) and value >= 0 else None


def usage_in_sse(tail: bytes) -> int | None:
    """The cached tokens of the last SSE event in `tail` that carries usage, or None.

    A stream asked for ``include_usage`` ends with a chunk whose ``usage``
    is set (then ``data: [DONE]``); `tail` is the stream's last bytes.
    """
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if not line.startswith(b"data:") or b'"usage"' not in line:
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue  # cut at the tail's start, or not JSON: look further back
        if isinstance(event, dict):
            found = cached_tokens(event.get("usage"))
            if found is not None:
                return found
    return None
