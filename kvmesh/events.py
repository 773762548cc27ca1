"""KV events: how a worker tells the coordinator what its cache holds.

Every change of a worker's cached set is an event; events travel in batches
with a timestamp, the worker's id, its incarnation (new on every start, so a
restarted worker's sequence numbers starting again are never read as a gap or
as old batches) and a per-worker sequence number. A batch flagged `snapshot`
carries the worker's whole cached set and replaces what the index held.

Wire format (msgpack, arrays, the field order of vLLM's KV event schema so
that batches from a real vLLM engine decode with the same code)::

    batch  = [ts, [event, ...], data_parallel_rank, worker_id, incarnation, seq, snapshot]
    event  = ["BlockStored", hashes, parent_hash, token_ids, page_size, lora_id, medium, tenant]
           | ["BlockRemoved", hashes, medium, tenant]
           | ["AllBlocksCleared"]

A vLLM batch stops after `data_parallel_rank`; its worker id and sequence
number come from the ZMQ frame instead and are passed to `decode_batch`.
`tenant` is kvmesh's own trailing field (read only in kvmesh batches, since
vLLM puts other fields there, and optional, so batches without it decode):
the tenant the pages count against (`kvmesh.tenants.tenant_of`), one tenant
per event; nil is the default tenant.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from kvmesh.errors import EventDecodeError
from kvmesh.types import PageHash, WorkerId

MAX_BATCH_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class PagesStored:
    """Full pages entered the cache; `parent_hash` is the page before the first one."""

    page_hashes: tuple[PageHash, ...]
    parent_hash: PageHash | None
    token_ids: tuple[int, ...]
    page_size: int
    lora_id: int | None = None
    medium: str | None = None
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """Pages left the cache (evicted, or their page reused)."""

    page_hashes: tuple[PageHash, ...]
    medium: str | None = None
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class AllPagesCleared:
    """The whole cache was reset."""


KVEvent = PagesStored | PagesRemoved | AllPagesCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of one worker in the order they happened."""

    events: tuple[KVEvent, ...]
    worker_id: WorkerId
    incarnation: str
    seq: int
    ts: float = 0.0
    snapshot: bool = False
    data_parallel_rank: int | None = None


class ApplyResult(enum.Enum):
    """What an index (`kvmesh.coordinator.index.GlobalIndex`) did with a batch: the answer a
    batch's sender acts on (a stale worker resends a snapshot, a followed engine is healed)."""

    APPLIED = "applied"
    """Applied in order; the worker is up to date."""
    REPLACED = "replaced"
    """A snapshot or a new incarnation replaced the worker's entries."""
    IGNORED = "ignored"
    """A duplicate, an old batch, or one from a retired incarnation: nothing changed."""
    STALE = "stale"
    """The worker has a gap in its sequence: it is stale until a snapshot (or the gap fills)."""

    @property
    def needs_snapshot(self) -> bool:
        return self is ApplyResult.STALE


def make_batch(
    events: Iterable[KVEvent],
    worker_id: WorkerId,
    incarnation: str,
    seq: int,
    *,
    snapshot: bool = False,
) -> EventBatch:
    return EventBatch(tuple(events), worker_id, incarnation, seq, time.time(), snapshot)


def _encode_event(ev: KVEvent) -> list[Any]:
    if isinstance(ev, PagesStored):
        return [
            "BlockStored",
            list(ev.page_hashes),
            ev.parent_hash,
            list(ev.token_ids),
            ev.page_size,
            ev.lora_id,
            ev.medium,
            ev.tenant,
        ]
    if isinstance(ev, PagesRemoved):
        return ["BlockRemoved", list(ev.page_hashes), ev.medium, ev.tenant]
    return ["AllBlocksCleared"]


def encode_batch(batch: EventBatch) -> bytes:
    """msgpack bytes of `batch` (see the module docstring for the layout)."""
    return msgpack.packb(
        [
            batch.ts,
            [_encode_event(e) for e in batch.events],
            batch.data_parallel_rank,
            batch.worker_id,
            batch.incarnation,
            batch.seq,
            batch.snapshot,
        ],
        use_bin_type=True,
    )


def _hash(value: Any, where: str) -> PageHash:
    if isinstance(value, bytes) and 0 < len(value) <= 64:
        return PageHash(value)
    if isinstance(value, int) and not isinstance(value, bool):  # vLLM's older int hashes
        return PageHash((value & (2**128 - 1)).to_bytes(16, "big"))
    raise EventDecodeError(f"{where}: a page hash must be 1-64 bytes, got {type(value).__name__}")


def _hashes(value: Any, where: str) -> tuple[PageHash, ...]:
    if not isinstance(value, list):
        raise EventDecodeError(f"{where}: page hashes must be a list, got {type(value).__name__}")
    # The common case, all 1-64 bytes, checked in C-level passes (a Python call per
    # hash was half of a coordinator's report); anything else goes one by one.
    if (
        value
        and set(map(type, value)) == {bytes}
        and min(map(len, value)) > 0
        and max(map(len, value)) <= 64
    ):
        return tuple(value)
    return tuple(_hash(v, where) for v in value)


def _opt(value: Any, kind: type, where: str) -> Any:
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise EventDecodeError(f"{where}: expected {kind.__name__} or nil, got {type(value).__name__}")


def _decode_event(raw: Any, i: int, kvmesh_fields: bool = False) -> KVEvent:
    """`kvmesh_fields`: the batch is kvmesh's own, so trailing kvmesh fields (tenant) are read."""
    where = f"event {i}"
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise EventDecodeError(f"{where}: an event must be a tagged array")
    tag = raw[0]
    if tag == "BlockStored":
        if len(raw) < 7:
            raise EventDecodeError(f"{where}: BlockStored needs 6 fields, got {len(raw) - 1}")
        hashes = _hashes(raw[1], where)
        parent = None if raw[2] is None else _hash(raw[2], where + " parent")
        tokens = raw[3]
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            raise EventDecodeError(f"{where}: token_ids must be a list of non-negative ints")
        size = raw[4]
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise EventDecodeError(f"{where}: page_size must be a positive int, got {size!r}")
        if tokens and len(tokens) != size * len(hashes):
            raise EventDecodeError(
                f"{where}: {len(hashes)} pages of {size} tokens need {size * len(hashes)} "
                f"token ids, got {len(tokens)}"
            )
        tenant = _opt(raw[7], str, where) if kvmesh_fields and len(raw) > 7 else None
        return PagesStored(
            hashes,
            parent,
            tuple(tokens),
            size,
            _opt(raw[5], int, where),
            _opt(raw[6], str, where),
            tenant,
        )
    if tag == "BlockRemoved":
        if len(raw) < 3:
            raise EventDecodeError(f"{where}: BlockRemoved needs 2 fields, got {len(raw) - 1}")
        tenant = _opt(raw[3], str, where) if kvmesh_fields and len(raw) > 3 else None
        return PagesRemoved(_hashes(raw[1], where), _opt(raw[2], str, where), tenant)
    if tag == "AllBlocksCleared":
        return AllPagesCleared()
    raise EventDecodeError(f"{where}: unknown event type {tag!r}")


def decode_batch(
    data: bytes,
    *,
    worker_id: WorkerId | None = None,
    seq: int | None = None,
    incarnation: str = "",
    max_bytes: int = MAX_BATCH_BYTES,
) -> EventBatch:
    """Decode and validate a batch; raises `EventDecodeError`, never anything else.

    `worker_id` and `seq` fill in what a vLLM batch does not carry itself.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise EventDecodeError(f"an event batch must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise EventDecodeError(f"event batch of {len(data)} bytes exceeds the {max_bytes} limit")
    try:
        raw = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for malformed input
        raise EventDecodeError(f"event batch is not valid msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2:
        raise EventDecodeError("an event batch must be an array [ts, events, ...]")
    ts, events = raw[0], raw[1]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise EventDecodeError(f"batch timestamp must be a number, got {type(ts).__name__}")
    if not math.isfinite(ts):
        raise EventDecodeError(f"batch timestamp must be finite, got {ts!r}")
    if not isinstance(events, list):
        raise EventDecodeError("batch events must be an array")
    dp_rank = _opt(raw[2], int, "data_parallel_rank") if len(raw) > 2 else None
    if len(raw) >= 6:
        wid, inc, sq = raw[3], raw[4], raw[5]
        snap = raw[6] if len(raw) > 6 else False
        if not isinstance(wid, str) or not wid:
            raise EventDecodeError("batch worker_id must be a non-empty string")
        if not isinstance(inc, str):
            raise EventDecodeError("batch incarnation must be a string")
        if not isinstance(sq, int) or isinstance(sq, bool) or sq < 0:
            raise EventDecodeError(f"batch seq must be a non-negative int, got {sq!r}")
        if not isinstance(snap, bool):
            raise EventDecodeError("batch snapshot flag must be a bool")
        worker_id, incarnation, seq = WorkerId(wid), inc, sq
    else:
        snap = False
        if worker_id is None or seq is None:
            raise EventDecodeError(
                "a vLLM-style batch carries no worker id or sequence number: pass them to decode_batch"
            )
    kvmesh_batch = len(raw) >= 6
    decoded = tuple(_decode_event(e, i, kvmesh_batch) for i, e in enumerate(events))
    return EventBatch(decoded, worker_id, incarnation, seq, float(ts), snap, dp_rank)


def replay_into(cached: set[PageHash], events: Iterable[KVEvent]) -> set[PageHash]:
    """Apply events to a set of cached hashes (the reference model tests compare with)."""
    for ev in events:
        if isinstance(ev, PagesStored):
            cached.update(ev.page_hashes)
        elif isinstance(ev, PagesRemoved):
            cached.difference_update(ev.page_hashes)
        else:
            cached.clear()
    return cached
