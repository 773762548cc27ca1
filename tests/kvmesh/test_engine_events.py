"""Decoding vLLM's KV event payloads: both encodings, omitted defaults, all-or-nothing refusal."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine_events import EngineBatch, decode_engine_payload, decode_seq
from kvmesh.engine_hash import EngineHasher
from kvmesh.errors import EventDecodeError
from kvmesh.events import AllPagesCleared, PagesRemoved, PagesStored
from kvmesh.types import PageHash, WorkerId


def h(i: int) -> PageHash:
    return PageHash(i.to_bytes(8, "big"))


def stored_map(hashes: list[Any], tokens: list[int], size: int, **extra: Any) -> dict[str, Any]:
    """A BlockStored as vLLM 0.32 writes it: `type` first, required fields, defaults omitted."""
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    event.update(extra)
    return event


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_a_vllm_032_batch_of_maps_decodes_to_kvmesh_events() -> None:
    payload = pack(
        [
            1795533923.5,
            [
                stored_map([1, 2], list(range(8)), 4, extra_keys=[None, None], group_idx=0,
                           kv_cache_spec_kind="full_attention"),
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )
    batch = decode_engine_payload(payload)
    assert batch == EngineBatch(
        1795533923.5,
        (
            PagesStored((h(1), h(2)), None, tuple(range(8)), 4, None, "GPU"),
            PagesRemoved((h(1),), "GPU"),
            AllPagesCleared(),
        ),
        0,
    )


# Encoded by vLLM 0.32's own KVEventBatch (msgspec) in .venv-engine: a BlockStored of the
# two blocks of token ids 5..68 (their real hashes), a BlockRemoved, an AllBlocksCleared.
VLLM_032_PAYLOAD = bytes.fromhex(
    "93cb41dac16b18e00000938ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf"
    "50b45e1a85936f95cf98b200da158bb656b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69"
    "6473dc004005060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b"
    "2c2d2e2f303132333435363738393a3b3c3d3e3f4041424344aa626c6f636b5f73697a6520a76c6f72615f69"
    "64c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f7570"
    "5f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e83a4747970"
    "65ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf50b45e1a85936f95a66d656469756d"
    "a347505581a474797065b0416c6c426c6f636b73436c656172656400"
)


def test_bytes_vllms_own_encoder_wrote_decode_to_the_hashes_kvmesh_computes() -> None:
    batch = decode_engine_payload(VLLM_032_PAYLOAD)
    want = EngineHasher("sha256", 32).hash_prompt(range(5, 69))
    assert batch.data_parallel_rank == 0 and batch.ts == 1795533923.5
    stored_ev, removed_ev, cleared_ev = batch.events
    assert stored_ev == PagesStored(tuple(want), None, tuple(range(5, 69)), 32, None, "GPU")
    assert removed_ev == PagesRemoved((want[0],), "GPU")
    assert cleared_ev == AllPagesCleared()


def test_the_older_array_encoding_decodes_the_same() -> None:
    maps = pack([2.0, [stored_map([7], [1, 2], 2), {"type": "BlockRemoved", "block_hashes": [7],
                                                     "medium": None}]])  # fmt: skip
    arrays = pack([2.0, [["BlockStored", [7], None, [1, 2], 2, None, "GPU"],
                         ["BlockRemoved", [7], None]]])  # fmt: skip
    assert decode_engine_payload(maps) == decode_engine_payload(arrays)


def test_omitted_dp_rank_and_optional_fields_take_their_defaults() -> None:
    payload = pack([1, [{"type": "BlockStored", "block_hashes": [3], "token_ids": [9], "block_size": 1}]])
    batch = decode_engine_payload(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == (PagesStored((h(3),), None, (9,), 1, None, None),)


def test_digest_hashes_stay_bytes_and_int_parents_become_eight_bytes() -> None:
    digest = bytes(range(32))
    payload = pack([1.0, [stored_map([digest], [1], 1, parent_block_hash=2**64 - 1)]])
    (event,) = decode_engine_payload(payload).events
    assert isinstance(event, PagesStored)
    assert event.page_hashes == (PageHash(digest),) and event.parent_hash == b"\xff" * 8


def test_unknown_fields_are_ignored_for_newer_engines() -> None:
    payload = pack([1.0, [stored_map([1], [1], 1, session_id="s", locality="LOCAL", new=[1])]])
    assert len(decode_engine_payload(payload).events) == 1


def test_events_of_other_kv_groups_are_skipped_and_counted() -> None:
    payload = pack([1.0, [stored_map([1], [1], 1, group_idx=1), stored_map([2], [2], 1, group_idx=0)]])
    batch = decode_engine_payload(payload)
    assert [e.page_hashes for e in batch.events if isinstance(e, PagesStored)] == [(h(2),)]
    assert batch.skipped_events == 1
    assert len(decode_engine_payload(payload, kv_group=1).events) == 1


def test_to_event_batch_carries_the_frames_seq_and_the_subscribers_identity() -> None:
    batch = decode_engine_payload(pack([3.0, [{"type": "AllBlocksCleared"}], 2]))
    ev = batch.to_event_batch(WorkerId("engine-0@dp2"), "inc-1", 41)
    assert (ev.worker_id, ev.incarnation, ev.seq, ev.ts, ev.data_parallel_rank) == (
        "engine-0@dp2", "inc-1", 41, 3.0, 2
    )  # fmt: skip


def test_seq_frames_are_eight_byte_big_endian() -> None:
    assert decode_seq((258).to_bytes(8, "big")) == 258
    for bad in (b"", b"\x00" * 7, b"\x00" * 9):
        with pytest.raises(EventDecodeError, match="8 bytes"):
            decode_seq(bad)


BAD_PAYLOADS: dict[str, Any] = {
    "not an array": {"ts": 1},
    "too short": [1.0],
    "too long": [1.0, [], 0, "extra"],
    "nan timestamp": [math.nan, []],
    "string timestamp": ["now", []],
    "events not an array": [1.0, {}],
    "negative dp rank": [1.0, [], -1],
    "unknown type": [1.0, [{"type": "BlockMoved"}]],
    "map without type": [1.0, [{"block_hashes": []}]],
    "untagged array": [1.0, [[1, 2]]],
    "missing hashes": [1.0, [{"type": "BlockRemoved"}]],
    "missing token ids": [1.0, [{"type": "BlockStored", "block_hashes": [], "block_size": 1}]],
    "float hash": [1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]],
    "bool hash": [1.0, [{"type": "BlockRemoved", "block_hashes": [True]}]],
    "empty digest": [1.0, [{"type": "BlockRemoved", "block_hashes": [b""]}]],
    "token count": [1.0, [stored_map([1, 2], [1, 2, 3], 2)]],
    "zero block size": [1.0, [stored_map([], [], 0)]],
    "negative token": [1.0, [stored_map([1], [-1], 1)]],
    "medium int": [1.0, [stored_map([1], [1], 1, medium=3)]],
    "extra keys per block": [1.0, [stored_map([1], [1], 1, extra_keys=[None, None])]],
    "extra keys type": [1.0, [stored_map([1], [1], 1, extra_keys="x")]],
    "group string": [1.0, [stored_map([1], [1], 1, group_idx="0")]],
}


@pytest.mark.parametrize("name", sorted(BAD_PAYLOADS))
def test_malformed_payloads_raise_event_decode_error(name: str) -> None:
    with pytest.raises(EventDecodeError):
        decode_engine_payload(pack(BAD_PAYLOADS[name]))


def test_one_bad_event_refuses_the_whole_batch() -> None:
    payload = pack([1.0, [stored_map([1], [1], 1), {"type": "BlockRemoved", "block_hashes": "x"}]])
    with pytest.raises(EventDecodeError, match="event 1"):
        decode_engine_payload(payload)


def test_oversized_and_non_bytes_payloads_are_refused() -> None:
    with pytest.raises(EventDecodeError, match="exceeds"):
        decode_engine_payload(pack([1.0, []]), max_bytes=3)
    with pytest.raises(EventDecodeError, match="bytes"):
        decode_engine_payload("[1, []]")  # type: ignore[arg-type]


def test_msgpack_extension_types_are_refused() -> None:
    payload = msgpack.packb([msgpack.ExtType(5, b"x"), []])
    with pytest.raises(EventDecodeError):
        decode_engine_payload(payload)


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_event_decode_error_only(data: bytes) -> None:
    with contextlib.suppress(EventDecodeError):
        decode_engine_payload(data)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=40) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                         "medium", "extra_keys", "group_idx", "lora_id"]), inner, max_size=6),
    max_leaves=30,
)  # fmt: skip


@settings(max_examples=300)
@given(st.tuples(st.floats(), st.lists(msgpack_values, max_size=4), msgpack_values))
def test_random_msgpack_batches_decode_or_raise_event_decode_error_only(raw: Any) -> None:
    try:
        batch = decode_engine_payload(pack(list(raw)))
    except EventDecodeError:
        return
    assert all(isinstance(e, PagesStored | PagesRemoved | AllPagesCleared) for e in batch.events)


def valid_batch(n_blocks: int, size: int) -> list[Any]:
    return [
        5.0,
        [
            stored_map(list(range(1, n_blocks + 1)), list(range(n_blocks * size)), size,
                       parent_block_hash=99, extra_keys=[None] * n_blocks, group_idx=0),
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
        ],
        0,
    ]  # fmt: skip


MUTATIONS = {
    "drop a required field": lambda b: b[1][0].pop("token_ids"),
    "hash to string": lambda b: b[1][0]["block_hashes"].__setitem__(0, "ab"),
    "parent to list": lambda b: b[1][0].__setitem__("parent_block_hash", [1]),
    "block size to float": lambda b: b[1][0].__setitem__("block_size", 2.0),
    "one token too many": lambda b: b[1][0]["token_ids"].append(0),
    "type to int": lambda b: b[1][1].__setitem__("type", 1),
    "removed hashes to map": lambda b: b[1][1].__setitem__("block_hashes", {"a": 1}),
    "ts to nil": lambda b: b.__setitem__(0, None),
    "rank to string": lambda b: b.__setitem__(2, "0"),
    "lora name to int": lambda b: b[1][0].__setitem__("lora_name", 3),
}


@given(st.integers(1, 4), st.integers(1, 8), st.sampled_from(sorted(MUTATIONS)))
def test_every_mutation_of_a_valid_batch_is_refused_whole(n: int, size: int, name: str) -> None:
    raw = valid_batch(n, size)
    assert len(decode_engine_payload(pack(raw)).events) == 2
    MUTATIONS[name](raw)
    with pytest.raises(EventDecodeError):
        decode_engine_payload(pack(raw))


@given(st.integers(1, 4), st.integers(1, 8), st.data())
def test_a_truncated_valid_payload_is_refused(n: int, size: int, data: st.DataObject) -> None:
    payload = pack(valid_batch(n, size))
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(EventDecodeError):
        decode_engine_payload(payload[:cut])
