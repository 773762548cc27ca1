"""The page wire codec (`kvmesh.worker.page_codec`): byte-exact protobuf, any field order,
malformed bytes refused with `InvalidInput`, sizes checked before anything is buffered."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.errors import InvalidInput, PageFormatError
from kvmesh.proto import kvmesh_pb2
from kvmesh.worker.page_codec import PageAssembler, decode_chunk, encode_chunk


def test_hand_encoded_chunks_are_byte_identical_to_protobuf() -> None:
    header = kvmesh_pb2.PageHeader(page_hash=b"h" * 32, token_ids=[1, 2, 300], nbytes=9, checksum=7)
    data = bytes(range(200))
    ours = encode_chunk(3, 4096, memoryview(data), header=header)
    theirs = kvmesh_pb2.PageChunk(page_index=3, offset=4096, header=header, data=data)
    assert ours == theirs.SerializeToString()
    decoded = decode_chunk(theirs.SerializeToString())
    assert bytes(decoded.data) == data and decoded.meta.header == header
    assert decoded.meta.page_index == 3 and decoded.meta.offset == 4096


def test_decoding_accepts_fields_in_any_order() -> None:
    head = kvmesh_pb2.PageChunk(page_index=1, offset=8).SerializeToString()
    body = kvmesh_pb2.PageChunk(data=b"xyz").SerializeToString()
    decoded = decode_chunk(body + head)
    assert (
        bytes(decoded.data) == b"xyz" and decoded.meta.page_index == 1 and decoded.meta.offset == 8
    )


@pytest.mark.parametrize("raw", [b"\x7a\x05ab", b"\x08", b"\x0f", b"\x12\x02\xff\xff"])
def test_malformed_chunks_are_invalid_input(raw: bytes) -> None:
    with pytest.raises(InvalidInput, match="malformed"):
        decode_chunk(raw)


def test_the_assembler_refuses_a_page_of_the_wrong_size_before_buffering() -> None:
    header = kvmesh_pb2.PageHeader(
        page_hash=b"h" * 32, dtype="float32", shape=[1 << 30], nbytes=1 << 32
    )
    assembler = PageAssembler(expect_nbytes=8192)
    with pytest.raises(PageFormatError, match="same model"):
        assembler.add(decode_chunk(encode_chunk(0, 0, b"x" * 10, header=header)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_to_a_chunk_or_invalid_input_never_a_crash(raw: bytes) -> None:
    try:
        chunk = decode_chunk(raw)
    except InvalidInput:
        return
    assert chunk.data.nbytes <= len(raw)
    with contextlib.suppress(InvalidInput, PageFormatError):
        PageAssembler(expect_nbytes=8192, allow_missing=True).add(chunk)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**40), st.binary(max_size=64), st.booleans())
def test_encode_then_decode_returns_the_same_chunk(
    index: int, offset: int, data: bytes, missing: bool
) -> None:
    header = kvmesh_pb2.PageHeader(page_hash=b"k" * 16, nbytes=len(data))
    decoded = decode_chunk(encode_chunk(index, offset, data, header=header, missing=missing))
    assert (decoded.meta.page_index, decoded.meta.offset, decoded.meta.missing) == (
        index,
        offset,
        missing,
    )
    assert bytes(decoded.data) == data and decoded.meta.header == header
