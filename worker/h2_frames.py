"""The HTTP/2 and gRPC vocabulary of the FetchPages reader (`kvmesh.worker.grpc_wire`).

Frame types, flags and settings (RFC 9113 section 6), the fixed 9-byte frame
header, gRPC's ``grpc-timeout`` header and status codes, the error a call
raises (`WireStatus`, a `grpc.RpcError` like grpcio's) and where a call's
chunks go (`ChunkSink`). Nothing here does I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Protocol

import grpc

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.worker.page_codec import SERVICE_NAME

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FETCH_PATH = f"/{SERVICE_NAME}/FetchPages"

# HTTP/2 frame types and flags (RFC 9113, section 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x2, 0x4, 0x5
MAX_WINDOW = 2**31 - 1
MAX_FRAME = 2**24 - 1
DEFAULT_WINDOW, DEFAULT_FRAME = 65535, 16384  # a peer's limits until its SETTINGS say otherwise
MAX_STREAM_ID = 2**31 - 1


class WireStatus(grpc.RpcError):
    """A FetchPages call over a `WireChannel` ended with a non-OK gRPC status."""

    def __init__(
        self, code: grpc.StatusCode, details: str, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._metadata = tuple(metadata)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


class ChunkSink(Protocol):
    """Where a call's ``PageChunk``\\s go: the caller picks each chunk's data destination."""

    def target(self, meta: pb.PageChunk, nbytes: int) -> memoryview:
        """A writable view of exactly `nbytes` for this chunk's data (meta has no data)."""

    def landed(self, meta: pb.PageChunk, data: memoryview) -> None:
        """The chunk's data is in the view `target` returned."""


STATUS_BY_VALUE = {s.value[0]: s for s in grpc.StatusCode}


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """The 9-byte header of a frame carrying `payload` (the payload itself not included)."""
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream)


def timeout_header(seconds: float) -> str:
    """``grpc-timeout``: at most 8 digits and a unit."""
    ms = max(1, int(seconds * 1000))
    return f"{ms}m" if ms < 10**8 else f"{min(int(seconds), 10**8 - 1)}S"
