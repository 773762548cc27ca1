"""KV event batches: round trip, vLLM compatibility, strict rejection of bad input."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.errors import EventDecodeError
from kvmesh.events import (
    AllPagesCleared,
    EventBatch,
    PagesRemoved,
    PagesStored,
    decode_batch,
    encode_batch,
    make_batch,
    replay_into,
)
from kvmesh.types import PageHash, WorkerId

H1, H2 = PageHash(b"\x01" * 32), PageHash(b"\x02" * 32)


def _batch() -> EventBatch:
    return make_batch(
        [
            PagesStored((H1, H2), None, tuple(range(8)), 4, 7, "gpu"),
            PagesRemoved((H1,), "gpu"),
            AllPagesCleared(),
        ],
        WorkerId("worker-0"),
        "inc-1",
        5,
    )


def test_round_trip_is_exact() -> None:
    b = _batch()
    assert decode_batch(encode_batch(b)) == b


def test_wire_layout_follows_vllm_field_order() -> None:
    raw = msgpack.unpackb(encode_batch(_batch()))
    assert raw[1][0] == ["BlockStored", [H1, H2], None, list(range(8)), 4, 7, "gpu", None]
    assert raw[1][1] == ["BlockRemoved", [H1], "gpu", None]
    assert raw[1][2] == ["AllBlocksCleared"]
    assert raw[3:6] == ["worker-0", "inc-1", 5]


def test_a_vllm_engine_batch_decodes_with_the_worker_and_seq_given() -> None:
    vllm_batch = msgpack.packb(
        [1.5, [["BlockStored", [123, 456], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"]], 0]
    )
    b = decode_batch(vllm_batch, worker_id=WorkerId("vllm-0"), seq=3)
    assert b.worker_id == "vllm-0" and b.seq == 3 and b.data_parallel_rank == 0
    ev = b.events[0]
    assert isinstance(ev, PagesStored) and len(ev.page_hashes) == 2
    with pytest.raises(EventDecodeError, match="pass them"):
        decode_batch(vllm_batch)


def test_the_tenant_travels_in_kvmesh_batches_and_is_never_read_from_vllm_fields() -> None:
    events = (
        PagesStored((H1,), None, (), 4, None, "cpu", "t-quiet"),
        PagesRemoved((H1,), "gpu", "t-quiet"),
    )
    b = decode_batch(encode_batch(make_batch(events, WorkerId("w"), "i", 0)))
    assert b.events == events
    vllm_batch = msgpack.packb(  # vLLM's lora_name sits where kvmesh keeps the tenant
        [1.5, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU", "my-lora"]], 0]
    )
    ev = decode_batch(vllm_batch, worker_id=WorkerId("vllm-0"), seq=0).events[0]
    assert isinstance(ev, PagesStored) and ev.tenant is None
    with pytest.raises(EventDecodeError, match="expected str or nil"):
        decode_batch(msgpack.packb([1.0, [["BlockRemoved", [H1], None, 5]], None, "w", "i", 0]))


BAD = [
    b"\xc1",  # never used in msgpack
    msgpack.packb({"ts": 1}),
    msgpack.packb([1.0, "events"]),
    msgpack.packb(["now", []]),
    msgpack.packb(
        [1.0, [["BlockStored", [H1], None, [1, 2, 3], 4, None, None]], None, "w", "i", 0]
    ),
    msgpack.packb(
        [1.0, [["BlockStored", ["nothash"], None, [], 4, None, None]], None, "w", "i", 0]
    ),
    msgpack.packb(
        [1.0, [["BlockStored", [H1], None, [-1, 2, 3, 4], 4, None, None]], None, "w", "i", 0]
    ),
    msgpack.packb([1.0, [["BlockStored", [H1], None, [], 0, None, None]], None, "w", "i", 0]),
    msgpack.packb([1.0, [["BlockRemoved"]], None, "w", "i", 0]),
    msgpack.packb([1.0, [["Exploded", 1]], None, "w", "i", 0]),
    msgpack.packb([1.0, [], None, "", "i", 0]),
    msgpack.packb([1.0, [], None, "w", "i", -1]),
    msgpack.packb([1.0, [], None, "w", "i", True]),
    msgpack.packb([1.0, [], None, "w", 5, 0]),
]


@pytest.mark.parametrize("data", BAD)
def test_malformed_batches_raise_event_decode_error(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(data)


def test_non_bytes_and_oversized_batches_are_rejected() -> None:
    with pytest.raises(EventDecodeError, match="bytes"):
        decode_batch("text")  # type: ignore[arg-type]
    with pytest.raises(EventDecodeError, match="limit"):
        decode_batch(encode_batch(_batch()), max_bytes=10)


@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    with contextlib.suppress(EventDecodeError):
        decode_batch(data)


def test_replay_into_applies_events_in_order() -> None:
    assert replay_into(set(), _batch().events) == set()
    assert replay_into(set(), _batch().events[:2]) == {H2}
