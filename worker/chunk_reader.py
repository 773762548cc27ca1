"""FetchPages' reply messages read off a stream of DATA bytes, page bytes landing in place.

A gRPC message is a 5-byte prefix (compressed flag, length) and a protobuf
``PageChunk``. Its small fields (page index, offset, header) are parsed as
they arrive; its ``data`` field, which every protobuf encoder writes last,
is not buffered: the sink names a destination (a reserved page of the KV
store) and the bytes are read straight into it. This module knows gRPC's
framing and protobuf's wire format, not HTTP/2: the `DataStream` it reads
from (`kvmesh.worker.grpc_wire.WireChannel`) hides frames, padding and flow
control.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.worker.h2_frames import ChunkSink, WireStatus
from kvmesh.worker.page_codec import encode_varint

_DATA_KEY = (pb.PageChunk.DESCRIPTOR.fields_by_name["data"].number << 3) | 2  # length-delimited


class DataStream(Protocol):
    """A call's reply bytes, message after message, across however many frames."""

    def read_bytes(self, n: int) -> bytes:
        """Exactly `n` bytes inside a message; raises if the stream ends first."""

    def read_into(self, dst: memoryview, *, at_boundary: bool = False) -> bool:
        """Fill `dst`; False when the stream ended before its first byte at a message boundary."""

    def fail(self, code: grpc.StatusCode, details: str) -> WireStatus:
        """The error to raise, marking the connection unusable."""


def read_chunk_message(stream: DataStream, sink: ChunkSink, max_message: int) -> bool:
    """Read one ``PageChunk`` message into `sink`; False at the end of the stream.

    Refuses (`WireStatus` from `stream.fail`) compressed or oversized messages,
    fields running past the message, and data that is not the last field.
    """
    prefix = bytearray(5)
    if not stream.read_into(memoryview(prefix), at_boundary=True):
        return False
    if prefix[0] != 0:
        raise stream.fail(grpc.StatusCode.INTERNAL, "compressed messages are not accepted")
    length = int.from_bytes(prefix[1:5], "big")
    if length > max_message:
        raise stream.fail(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"a message of {length} bytes is over the limit of {max_message}",
        )
    meta = bytearray()
    left = length
    while left:
        key, n = _varint(stream)
        left -= n
        if key == _DATA_KEY:
            size, n = _varint(stream)
            left -= n
            if size > left:
                raise _past_end(stream)
            if left != size:
                raise stream.fail(
                    grpc.StatusCode.INTERNAL, "PageChunk data is not the message's last field"
                )
            chunk = _parse(stream, meta)
            dst = sink.target(chunk, size)
            stream.read_into(dst)
            sink.landed(chunk, dst)
            return True
        meta += encode_varint(key)
        kind = key & 7
        if kind == 0:
            value, n = _varint(stream)
            meta += encode_varint(value)
        elif kind == 2:
            size, n = _varint(stream)
            meta += encode_varint(size)
            if size > left - n:
                raise _past_end(stream)
            meta += stream.read_bytes(size)
            n += size
        elif kind in (1, 5):
            n = 8 if kind == 1 else 4
            meta += stream.read_bytes(n)
        else:
            raise stream.fail(grpc.StatusCode.INTERNAL, f"PageChunk has wire type {kind}")
        left -= n
        if left < 0:
            raise _past_end(stream)
    chunk = _parse(stream, meta)
    sink.landed(chunk, sink.target(chunk, 0))
    return True


def _past_end(stream: DataStream) -> WireStatus:
    return stream.fail(grpc.StatusCode.INTERNAL, "a PageChunk field runs past its end")


def _parse(stream: DataStream, meta: bytearray) -> pb.PageChunk:
    try:
        return pb.PageChunk.FromString(bytes(meta))
    except Exception as exc:  # protobuf's DecodeError
        raise stream.fail(grpc.StatusCode.INTERNAL, f"malformed PageChunk: {exc}") from None


def _varint(stream: DataStream) -> tuple[int, int]:
    """A protobuf varint and how many bytes it took."""
    result = shift = n = 0
    while True:
        b = stream.read_bytes(1)[0]
        n += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, n
        shift += 7
        if shift > 63:
            raise stream.fail(grpc.StatusCode.INTERNAL, "overlong varint in a PageChunk")
