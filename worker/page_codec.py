"""The wire format of `kvmesh.v1.KVWorker` pages: ``PageChunk`` encoding, decoding, reassembly.

A page travels as one or more ``PageChunk`` messages: the first carries its
``PageHeader`` (hash, parent, token ids, dtype, shape, size, checksum), the
rest continue its bytes at contiguous offsets; a hash the sender does not
hold is one ``missing`` chunk. Chunks are protobuf-encoded by hand around the
page bytes, ``<fields 1-4 by protobuf> <tag 15> <len> <data>``: the
byte-exact protobuf encoding (any protobuf client parses it), at one copy
(KV tensor -> message) instead of three. Decoding returns the data as a
memoryview into the received message.

Used by the server (FetchPages out, PushPages in) and the client (PushPages
out, FetchPages in); nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from kvmesh.config import TransferConfig
from kvmesh.errors import ConfigError, InvalidInput, PageFormatError
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.types import PageHash
from kvmesh.worker.kv_store import DTYPES, PageBlob
from kvmesh.worker.page_service import IncomingPage, PageInfo, check_hash

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVWorker"].full_name  # "kvmesh.v1.KVWorker"
PUSH_TICKET_KEY = "kvmesh-push-ticket"  # hex of the receiver's push grant (PushPages)
HEADER_RESERVE_BYTES = 64 * 1024
"""Room left in a message for everything but the page bytes (hashes, token ids, shape)."""
MIN_CHUNK_BYTES = 4 * 1024


_DATA_TAG = b"\x7a"  # field 15 (PageChunk.data), wire type 2 (length-delimited)
_DATA_FIELD = 15


def encode_varint(n: int) -> bytes:
    """A protobuf base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise InvalidInput("malformed PageChunk: truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def encode_chunk(
    page_index: int,
    offset: int,
    data: bytes | memoryview,
    *,
    header: pb.PageHeader | None = None,
    missing: bool = False,
) -> bytes:
    """One ``PageChunk`` as protobuf bytes, with `data` copied once (see the module doc)."""
    meta = pb.PageChunk(page_index=page_index, offset=offset, missing=missing)
    if header is not None:
        meta.header.CopyFrom(header)
    head = meta.SerializeToString()
    if not len(data):
        return head
    return b"".join((head, _DATA_TAG, encode_varint(memoryview(data).nbytes), data))


@dataclass(frozen=True, slots=True)
class WireChunk:
    """A decoded ``PageChunk``: its small fields (`meta`, without data) and the data bytes."""

    meta: pb.PageChunk
    data: memoryview


def decode_chunk(raw: bytes) -> WireChunk:
    """Parse a ``PageChunk`` from any protobuf encoder; `data` aliases `raw` (no copy).

    Raises `InvalidInput` on malformed bytes.
    """
    pos, n = 0, len(raw)
    data = memoryview(b"")
    spans: list[tuple[int, int]] = []
    while pos < n:
        start = pos
        key, pos = _read_varint(raw, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(raw, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _read_varint(raw, pos)
            if pos + length > n:
                raise InvalidInput("malformed PageChunk: a field runs past the message end")
            if field == _DATA_FIELD:
                data = memoryview(raw)[pos : pos + length]
                pos += length
                continue
            pos += length
        else:
            raise InvalidInput(f"malformed PageChunk: wire type {wire_type}")
        if pos > n:
            raise InvalidInput("malformed PageChunk: truncated field")
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], pos)
        else:
            spans.append((start, pos))
    rest = (
        raw[spans[0][0] : spans[0][1]] if len(spans) == 1 else b"".join(raw[a:b] for a, b in spans)
    )
    try:
        meta = pb.PageChunk.FromString(rest)
    except DecodeError as exc:
        raise InvalidInput(f"malformed PageChunk: {exc}") from None
    return WireChunk(meta, data)


def page_header(info: PageInfo, blob: PageBlob) -> pb.PageHeader:
    header = pb.PageHeader(
        page_hash=info.page_hash,
        parent_hash=info.parent_hash or b"",
        token_ids=info.token_ids,
        dtype=blob.dtype,
        shape=blob.shape,
        nbytes=blob.nbytes,
        checksum=blob.checksum,
        tier=info.tier,
    )
    if info.lora_id is not None:
        header.lora_id = info.lora_id
    return header


def iter_page_chunks(
    index: int, header: pb.PageHeader, data: memoryview, chunk_bytes: int
) -> Iterator[bytes]:
    """The encoded chunks of one page, lazily (the header rides on the first)."""
    yield encode_chunk(index, 0, data[:chunk_bytes], header=header)
    for off in range(chunk_bytes, data.nbytes, chunk_bytes):
        yield encode_chunk(index, off, data[off : off + chunk_bytes])


def first_chunk_header(meta: pb.PageChunk, expect_nbytes: int | None) -> pb.PageHeader:
    """The header a page's first chunk must carry, checked against the receiver's page size
    (None: any) before anything is allocated for the page."""
    if not meta.HasField("header") or meta.offset != 0:
        raise InvalidInput(f"page {meta.page_index} does not start with a header chunk")
    header = meta.header
    if expect_nbytes is not None and header.nbytes != expect_nbytes:
        raise PageFormatError(
            f"page {meta.page_index} declares {header.nbytes} bytes ({header.dtype} "
            f"{list(header.shape)}) but this KV store's pages are {expect_nbytes}: "
            "sender and receiver must run the same model config"
        )
    return header


class PageAssembler:
    """Rebuilds pages from a stream of `WireChunk`s, checking the framing as it goes.

    Pages must come in `page_index` order (0, 1, ...), each starting with a
    header chunk at offset 0 and continuing with contiguous offsets. A page
    that fits one chunk keeps the chunk's bytes (no copy); a larger page is
    copied into one buffer of its declared size, which is checked against
    `expect_nbytes` before anything is allocated.
    """

    __slots__ = ("_buf", "_filled", "_header", "_index", "allow_missing", "expect_nbytes")

    def __init__(self, expect_nbytes: int | None = None, *, allow_missing: bool = False) -> None:
        self.expect_nbytes = expect_nbytes
        self.allow_missing = allow_missing
        self._index = 0
        self._header: pb.PageHeader | None = None
        self._buf: np.ndarray | None = None
        self._filled = 0

    @property
    def next_index(self) -> int:
        """The page index the next page must carry."""
        return self._index

    def add(self, chunk: WireChunk) -> IncomingPage | PageHash | None:
        """Feed one chunk: a finished page, a missing page's hash, or None (need more)."""
        meta = chunk.meta
        if self._header is None:
            if meta.page_index != self._index:
                raise InvalidInput(
                    f"chunk for page {meta.page_index} arrived while page {self._index} was expected"
                )
            if meta.missing:
                if not self.allow_missing:
                    raise InvalidInput(f"page {meta.page_index} is marked missing in a push")
                self._index += 1
                return check_hash(meta.header.page_hash)
            header = first_chunk_header(meta, self.expect_nbytes)
            total = header.nbytes
            if chunk.data.nbytes == total:
                self._index += 1
                return incoming_page(header, chunk.data)
            self._header = header
            self._buf = np.empty(total, dtype=np.uint8)
            self._filled = 0
        elif meta.page_index != self._index or meta.HasField("header") or meta.missing:
            raise InvalidInput(
                f"page {self._index} is incomplete ({self._filled} of {self._header.nbytes} bytes) "
                f"but a chunk for page {meta.page_index} arrived"
            )
        buf = self._buf
        if buf is None:  # pragma: no cover - set together with _header
            raise InvalidInput("chunk without a page")
        size = chunk.data.nbytes
        if meta.offset != self._filled or self._filled + size > len(buf):
            raise InvalidInput(
                f"page {self._index}: chunk at offset {meta.offset} with {size} bytes does not "
                f"continue the {self._filled} of {len(buf)} bytes received"
            )
        # numpy copies without holding the GIL, so concurrent streams copy in parallel.
        buf[self._filled : self._filled + size] = np.frombuffer(chunk.data, dtype=np.uint8)
        self._filled += size
        if self._filled < len(buf):
            return None
        header = self._header
        self._header, self._buf = None, None
        self._index += 1
        return incoming_page(header, buf.data)

    def finish(self) -> None:
        """Raise if the stream ended inside a page."""
        if self._header is not None:
            raise InvalidInput(
                f"stream ended inside page {self._index} "
                f"({self._filled} of {self._header.nbytes} bytes received)"
            )


def incoming_page(header: pb.PageHeader, data: bytes | memoryview) -> IncomingPage:
    """The page a header chunk announces, with `data` as its bytes (dtype checked)."""
    if header.dtype not in DTYPES:
        raise PageFormatError(f"page has unknown dtype {header.dtype!r}; known: {sorted(DTYPES)}")
    return IncomingPage(
        page_hash=check_hash(header.page_hash),
        parent_hash=check_hash(header.parent_hash, "parent hash") if header.parent_hash else None,
        token_ids=tuple(header.token_ids),
        blob=PageBlob(data, header.dtype, tuple(header.shape), header.checksum),
        lora_id=header.lora_id if header.HasField("lora_id") else None,
    )


def chunk_size(config: TransferConfig) -> int:
    """The data bytes per message: `chunk_bytes`, kept under `max_message_bytes`."""
    room = config.max_message_bytes - HEADER_RESERVE_BYTES
    if room < MIN_CHUNK_BYTES:
        raise ConfigError(
            f"max_message_bytes {config.max_message_bytes} is too small: it must leave "
            f"{MIN_CHUNK_BYTES} bytes of page data after {HEADER_RESERVE_BYTES} for headers"
        )
    return max(MIN_CHUNK_BYTES, min(config.chunk_bytes, room))
