"""Strict decoding of a vLLM engine's KV event payloads into kvmesh events.

A vLLM engine publishes each batch of KV cache changes on ZMQ as the frames
``[topic, seq (8 bytes big-endian), payload]``; the payload is msgpack::

    batch = [ts, [event, ...]]  or  [ts, [event, ...], data_parallel_rank]
    event = {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | nil,
             "token_ids": [...], "block_size": n, "lora_id": ..., "medium": "GPU",
             "lora_name": ..., "extra_keys": [...], "group_idx": 0, ...}
          | {"type": "BlockRemoved", "block_hashes": [...], "medium": ..., "group_idx": ...}
          | {"type": "AllBlocksCleared"}

Fields with defaults are left out when they hold the default (msgspec's
``omit_defaults``) and unknown fields are ignored, so newer engines decode.
Older engines send each event as an array in field order instead of a map
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, ...]``); both forms decode. Block hashes are 64-bit ints
(vLLM's default) or byte digests; both become `PageHash` bytes through
`kvmesh.engine_hash.external_to_page_hash`, the form `EngineHasher` computes.

Only events of one KV cache group (``kv_group``, group 0 by default, the
full-attention group of a plain decoder) reach the index; a hybrid model's
other groups hold the same hashes for other layers and evict on their own.

Decoding is all or nothing: any malformed part raises `EventDecodeError` and
no event of the batch is returned, so a bad payload is never half applied.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from kvmesh.engine_hash import external_to_page_hash
from kvmesh.errors import EventDecodeError
from kvmesh.events import AllPagesCleared, EventBatch, KVEvent, PagesRemoved, PagesStored
from kvmesh.types import PageHash, WorkerId

MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
SEQ_BYTES = 8
_MIN_INT_HASH = -(1 << 63)
_MAX_INT_HASH = (1 << 64) - 1
_MAX_DIGEST_BYTES = 64


@dataclass(frozen=True, slots=True)
class EngineBatch:
    """One decoded engine payload: its events of the indexed KV group, in order."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    skipped_events: int = 0
    """Events of other KV cache groups, left out."""

    def to_event_batch(self, worker_id: WorkerId, incarnation: str, seq: int) -> EventBatch:
        """The kvmesh batch the `GlobalIndex` applies, under the frame's seq."""
        return EventBatch(self.events, worker_id, incarnation, seq, self.ts, False,
                          self.data_parallel_rank)  # fmt: skip


def _fail(where: str, what: str) -> EventDecodeError:
    return EventDecodeError(f"{where}: {what}")


def _is_int(value: object) -> bool:
    return type(value) is int


def _hash(value: object, where: str) -> PageHash:
    if isinstance(value, int) and not isinstance(value, bool):
        if not _MIN_INT_HASH <= value <= _MAX_INT_HASH:
            raise _fail(where, f"an int block hash must fit 64 bits, got {value}")
        return external_to_page_hash(value)
    if type(value) is bytes and 0 < len(value) <= _MAX_DIGEST_BYTES:
        return PageHash(value)
    raise _fail(where, f"a block hash must be a 64-bit int or 1-64 bytes, got {value!r:.40}")


def _hashes(value: object, where: str) -> tuple[PageHash, ...]:
    if type(value) is not list:
        raise _fail(where, f"block_hashes must be an array, got {type(value).__name__}")
    return tuple(_hash(v, where) for v in value)


def _opt_int(value: object, where: str, field: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise _fail(where, f"{field} must be an int or nil, got {value!r:.40}")


def _opt_str(value: object, where: str, field: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise _fail(where, f"{field} must be a string or nil, got {value!r:.40}")


def _tokens(value: object, where: str) -> tuple[int, ...]:
    if type(value) is not list or not all(_is_int(t) and t >= 0 for t in value):
        raise _fail(where, "token_ids must be an array of non-negative ints")
    return tuple(value)


def _extra_keys(value: object, blocks: int, where: str) -> None:
    if value is None:
        return
    if type(value) is not list or not all(v is None or type(v) is list for v in value):
        raise _fail(where, "extra_keys must be nil or an array of (array or nil), one per block")
    if len(value) != blocks:
        raise _fail(where, f"extra_keys has {len(value)} entries for {blocks} blocks")


@dataclass(frozen=True, slots=True)
class _Fields:
    """One event's fields by name, whichever form it came in."""

    values: Mapping[str, Any]
    where: str

    def get(self, name: str) -> Any:
        return self.values.get(name)

    def require(self, name: str) -> Any:
        if name not in self.values:
            raise _fail(self.where, f"{self.values.get('type')} lacks its {name!r} field")
        return self.values[name]


_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip
"""Field order of each event type in the older array encoding."""


def _fields(raw: object, where: str) -> _Fields:
    if type(raw) is dict:
        tag = raw.get("type")
        if type(tag) is not str:
            raise _fail(where, "an event map needs a string 'type'")
        return _Fields(raw, where)
    if type(raw) is list and raw and type(raw[0]) is str:
        names = _ARRAY_FIELDS.get(raw[0])
        if names is None:
            raise _fail(where, f"unknown event type {raw[0]!r}")
        values: dict[str, Any] = {"type": raw[0]}
        values.update(zip(names, raw[1:], strict=False))
        return _Fields(values, where)
    raise _fail(where, f"an event must be a map or a tagged array, got {type(raw).__name__}")


def _block_stored(f: _Fields) -> PagesStored:
    where = f.where
    hashes = _hashes(f.require("block_hashes"), where)
    parent_raw = f.get("parent_block_hash")
    parent = None if parent_raw is None else _hash(parent_raw, where + " parent")
    tokens = _tokens(f.require("token_ids"), where)
    size = f.require("block_size")
    if not _is_int(size) or size <= 0:
        raise _fail(where, f"block_size must be a positive int, got {size!r:.40}")
    if len(tokens) != size * len(hashes):
        raise _fail(
            where,
            f"{len(hashes)} blocks of {size} tokens need {size * len(hashes)} token ids, "
            f"got {len(tokens)}",
        )
    lora_id = _opt_int(f.get("lora_id"), where, "lora_id")
    medium = _opt_str(f.get("medium"), where, "medium")
    _opt_str(f.get("lora_name"), where, "lora_name")
    _extra_keys(f.get("extra_keys"), len(hashes), where)
    return PagesStored(hashes, parent, tokens, size, lora_id, medium)


def _block_removed(f: _Fields) -> PagesRemoved:
    where = f.where
    return PagesRemoved(
        _hashes(f.require("block_hashes"), where), _opt_str(f.get("medium"), where, "medium")
    )


def _all_cleared(f: _Fields) -> AllPagesCleared:
    return AllPagesCleared()


_DECODERS: dict[str, Callable[[_Fields], KVEvent]] = {
    "BlockStored": _block_stored,
    "BlockRemoved": _block_removed,
    "AllBlocksCleared": _all_cleared,
}
"""Registry of the engine's event types."""


def _decode_event(raw: object, i: int, kv_group: int) -> KVEvent | None:
    where = f"event {i}"
    f = _fields(raw, where)
    tag = f.values["type"]
    decoder = _DECODERS.get(tag)
    if decoder is None:
        raise _fail(where, f"unknown event type {tag!r}")
    event = decoder(f)
    group = _opt_int(f.get("group_idx"), where, "group_idx")
    if group is not None and group != kv_group and not isinstance(event, AllPagesCleared):
        return None
    return event


def decode_engine_payload(
    payload: bytes, *, kv_group: int = 0, max_bytes: int = MAX_PAYLOAD_BYTES
) -> EngineBatch:
    """Decode one payload; raises `EventDecodeError` (and nothing else) on any malformed part."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise EventDecodeError(f"an engine payload must be bytes, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise EventDecodeError(f"engine payload of {len(payload)} bytes exceeds {max_bytes}")
    try:
        raw = msgpack.unpackb(bytes(payload), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for malformed input
        raise EventDecodeError(f"engine payload is not valid msgpack: {exc}") from exc
    if type(raw) is not list or not 2 <= len(raw) <= 3:
        raise EventDecodeError("an engine payload must be an array [ts, events(, dp_rank)]")
    ts, events = raw[0], raw[1]
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise EventDecodeError(f"batch timestamp must be a finite number, got {ts!r:.40}")
    if type(events) is not list:
        raise EventDecodeError(f"batch events must be an array, got {type(events).__name__}")
    rank = _opt_int(raw[2], "batch", "data_parallel_rank") if len(raw) == 3 else None
    if rank is not None and rank < 0:
        raise EventDecodeError(f"data_parallel_rank must be >= 0, got {rank}")
    decoded = [_decode_event(e, i, kv_group) for i, e in enumerate(events)]
    kept = tuple(e for e in decoded if e is not None)
    return EngineBatch(float(ts), kept, rank, len(decoded) - len(kept))


def decode_seq(frame: bytes) -> int:
    """The sequence number frame of a published batch (8 bytes, big-endian, unsigned)."""
    if type(frame) is not bytes or len(frame) != SEQ_BYTES:
        raise EventDecodeError(f"a sequence frame must be {SEQ_BYTES} bytes, got {frame!r:.40}")
    return int.from_bytes(frame, "big")
