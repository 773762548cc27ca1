"""read_chunk_message: PageChunk messages parsed field by field, page bytes landing in place.

The stream here is the message bytes themselves (`BytesStream`); the HTTP/2
framing around them is `WireChannel`'s, tested against a real grpc server in
test_grpc_wire.py.
"""

from __future__ import annotations

import struct

import grpc
import pytest
from worker_kit import Recorder

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.worker.chunk_reader import read_chunk_message
from kvmesh.worker.h2_frames import WireStatus
from kvmesh.worker.page_codec import encode_chunk


class BytesStream:
    """A DataStream over fixed bytes: what WireChannel yields once frames are stripped."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.failed = False

    def read_bytes(self, n: int) -> bytes:
        out = bytearray(n)
        self.read_into(memoryview(out))
        return bytes(out)

    def read_into(self, dst: memoryview, *, at_boundary: bool = False) -> bool:
        if self.pos == len(self.data) and at_boundary:
            return False
        if self.pos + len(dst) > len(self.data):
            raise self.fail(grpc.StatusCode.INTERNAL, "stream ended inside a message")
        dst[:] = self.data[self.pos : self.pos + len(dst)]
        self.pos += len(dst)
        return True

    def fail(self, code: grpc.StatusCode, details: str) -> WireStatus:
        self.failed = True
        return WireStatus(code, details)


def framed(body: bytes, compressed: int = 0) -> bytes:
    return bytes([compressed]) + struct.pack(">I", len(body)) + body


def test_chunks_arrive_with_their_fields_and_data_until_the_stream_ends() -> None:
    header = pb.PageHeader(page_hash=b"h" * 16, dtype="float16", shape=[2, 3])
    stream = BytesStream(
        framed(encode_chunk(0, 0, b"abcd", header=header))
        + framed(encode_chunk(0, 4, b"ef"))
        + framed(encode_chunk(1, 0, b"", missing=True))
    )
    sink = Recorder()
    while read_chunk_message(stream, sink, 1 << 20):
        pass
    assert [(m.page_index, m.offset, m.missing, d) for m, d in sink.chunks] == [
        (0, 0, False, b"abcd"),
        (0, 4, False, b"ef"),
        (1, 0, True, b""),
    ]
    assert sink.chunks[0][0].header == header and not sink.chunks[0][0].data
    assert not stream.failed


def test_a_message_over_the_limit_is_resource_exhausted_before_it_is_read() -> None:
    stream = BytesStream(framed(encode_chunk(0, 0, b"x" * 100)))
    with pytest.raises(WireStatus) as err:
        read_chunk_message(stream, Recorder(), 50)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and stream.pos == 5


def test_compressed_messages_are_refused() -> None:
    with pytest.raises(WireStatus, match="compressed"):
        read_chunk_message(BytesStream(framed(encode_chunk(0, 0, b"x"), 1)), Recorder(), 1 << 20)


def test_data_that_is_not_the_last_field_is_refused() -> None:
    body = encode_chunk(0, 0, b"xy") + pb.PageChunk(offset=9).SerializeToString()
    with pytest.raises(WireStatus, match="last field"):
        read_chunk_message(BytesStream(framed(body)), Recorder(), 1 << 20)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"\x12\x05ab", "runs past its end"),  # a length-delimited field longer than the message
        (b"\x0b", "wire type 3"),  # group start: no PageChunk field uses it
        (b"\x08" + b"\xff" * 10 + b"\x01", "overlong varint"),
    ],
)
def test_malformed_fields_fail_the_call_as_internal(body: bytes, error: str) -> None:
    stream = BytesStream(framed(body))
    with pytest.raises(WireStatus, match=error) as err:
        read_chunk_message(stream, Recorder(), 1 << 20)
    assert err.value.code() == grpc.StatusCode.INTERNAL and stream.failed
