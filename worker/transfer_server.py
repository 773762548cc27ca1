"""The worker's gRPC transfer server (`kvmesh.v1.KVWorker`) and the page wire codec.

The server adapts a `PageService` to gRPC (`grpc.aio`):

- ``Lookup``: which hashes are held, in order;
- ``FetchPages``: pins pages as the stream goes, a window
  (``fetch_window_pages``) at a time, released once its pages are written,
  within caps per peer and for all streams (`PinBudget`: a stream over one
  waits ``fetch_pin_wait_s``, then ``RESOURCE_EXHAUSTED``); a server-side
  deadline (``fetch_stream_timeout_s``) and an idle timeout (one write the
  client does not read within ``fetch_idle_timeout_s``) end it with
  ``DEADLINE_EXCEEDED``; every pin is released on every path
  (``try/finally``); a hash not held is one ``missing`` chunk, not an error;
  pages larger than the chunk size travel as several chunks;
- ``PushPages``: only with a live push grant of this worker (the ticket in
  ``kvmesh-push-ticket`` metadata, else ``PERMISSION_DENIED`` before a byte
  is read); reassembles chunks, proves each page against the grant's request
  and checks it (`PageService.check`) and caches it, within the pusher's
  eviction budget; pages completed before an error stay, the rest are dropped;
- the standard ``grpc.health.v1.Health`` service, SERVING / NOT_SERVING by
  `set_serving` (draining);
- optional TLS, mutual TLS (`TransferConfig.tls_*`) and a bearer token checked
  by `TokenAuthInterceptor` (missing / wrong: ``UNAUTHENTICATED``).

A `KVMeshError` travels as its ``grpc_code`` with the class name in the
``kvmesh-error`` trailing metadata, so the client raises the same class.

Wire codec. ``PageChunk`` messages are protobuf-encoded by hand around the
page bytes, ``<fields 1-4 by protobuf> <tag 15> <len> <data>``, which is the
byte-exact protobuf encoding (any protobuf client can parse it), but costs one
copy (memoryview of the KV tensor -> message) instead of three. Decoding
returns the data as a memoryview into the received message.

Throughput (``kvmesh bench transfer``, 256 x 4 MiB pages on loopback, 2 cores
shared by both ends, where CPU per byte is the bound and the ratio to the raw
socket is roughly the ratio of the two paths' CPU cost). Counted in passes
over a page's bytes:

- sender: xxh3 over the pinned page in the KV tensor (the checksum; a pinned
  page is never written, so reading it in place is safe), ONE copy from the
  tensor into the message (`encode_chunk`: grpcio sends only ``bytes``), then
  grpcio copies the message into its own slice and the kernel into the socket;
- receiver with grpcio: the kernel copies into gRPC's read buffers, grpcio
  1.85 copies each slice into a Python ``bytes`` and joins them (two copies;
  its zero-copy receive is an unreleased experiment), then the page is
  checked (xxh3) and copied once more into the receiver's KV tensor. 16
  passes per byte in all against the raw socket's 4: 1.0-1.6 GB/s, 28-38% of
  the socket's 3.2-4.7 GB/s. Per GiB: sender ~0.5 s of CPU, receiver
  ~0.8-1.1 s, against ~0.2 s + ~0.15 s for the socket.
- receiver with `kvmesh.worker.grpc_wire` (``grpc_zero_copy``, the default
  for pulls into a pool): the kernel copies straight into the reserved
  pool page and xxh3 reads it while it is in cache: 1.6-2.0 GB/s, 48-66% of
  the socket in the same runs. The sender is now the bound.

What else measured:

- message size: 1-2 MiB per message is the sweet spot (the default
  ``chunk_bytes`` is 1 MiB): 4 MiB messages cost the sender more (44% of the
  socket against 59-66% at 1-2 MiB, zero-copy receiver); 256 KiB and below
  pay grpcio's per-message overhead;
- HTTP/2 frame size, stream windows, BDP probing, TCP read chunks and socket
  buffers (`grpc_tuning_options`, both ends): no difference beyond run-to-run
  noise (1.0-1.3 GB/s either way, grpcio receiver); settable for other
  machines, gRPC's defaults otherwise;
- preparing the next page's message on a helper thread while the loop writes
  (tried, dropped): no gain, more page faults on the helper thread's heap;
- `tune_malloc` (opt-in, process-wide): glibc stops returning freed buffers
  to the kernel between messages: 60k-150k fewer page faults per GiB received
  by grpcio, +15-20% GB/s there (e.g. 1.45 vs 1.22 GB/s, paired runs); with
  the zero-copy receiver, within noise.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.config import TransferConfig
from kvmesh.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    InvariantViolation,
    KVMeshError,
    PageFormatError,
    PinLimitExceeded,
    TransportError,
)
from kvmesh.grpc_security import (  # shared with the coordinator's routing API
    ERROR_METADATA_KEY,
    TokenAuthInterceptor,
    server_credentials,
)
from kvmesh.grpc_security import HEALTH_METHOD_PREFIX as HEALTH_METHOD_PREFIX
from kvmesh.grpc_security import client_tls_material as client_tls_material
from kvmesh.grpc_security import read_pem as read_pem
from kvmesh.metrics import FETCH_PINNED_PAGES, TRANSFER_REFUSED
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.types import PageHash, PageId
from kvmesh.worker.kv_store import DTYPES, PageBlob
from kvmesh.worker.page_service import IncomingPage, PageInfo, PageService, check_hash

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVWorker"].full_name  # "kvmesh.v1.KVWorker"
PUSH_TICKET_KEY = "kvmesh-push-ticket"  # hex of the receiver's push grant (PushPages)
PUSH_DRAIN_MESSAGES = 64  # messages a refused push may still have in flight, read and dropped
MAX_HASHES_PER_CALL = 100_000
HEADER_RESERVE_BYTES = 64 * 1024
"""Room left in a message for everything but the page bytes (hashes, token ids, shape)."""
MIN_CHUNK_BYTES = 4 * 1024


# ------------------------------------------------------------------ wire codec

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


# ------------------------------------------------------------------ security


# read_pem, client_tls_material, server_credentials, TokenAuthInterceptor: kvmesh.grpc_security


MIN_FRAME_BYTES = 16 * 1024
MAX_FRAME_BYTES = 16 * 1024 * 1024 - 1
"""HTTP/2's bounds on SETTINGS_MAX_FRAME_SIZE (RFC 9113 section 6.5.2)."""

GRPC_TUNING: dict[str, str] = {
    "grpc_frame_bytes": "grpc.http2.max_frame_size",
    "grpc_window_bytes": "grpc.http2.lookahead_bytes",
    "grpc_write_buffer_bytes": "grpc.http2.write_buffer_size",
    "grpc_read_chunk_bytes": "grpc.experimental.tcp_read_chunk_size",
    "grpc_min_read_chunk_bytes": "grpc.experimental.tcp_min_read_chunk_size",
    "grpc_max_read_chunk_bytes": "grpc.experimental.tcp_max_read_chunk_size",
    "grpc_socket_buffer_bytes": "grpc.tcp_receive_buffer_size",
}
"""`TransferConfig` field -> the gRPC channel argument it sets (0 leaves gRPC's default)."""


def grpc_tuning_options(config: TransferConfig) -> list[tuple[str, int]]:
    """The HTTP/2 and TCP channel arguments of `config`, for servers and clients alike.

    Raises `ConfigError` for a negative size or a frame size HTTP/2 does not allow.
    """
    out: list[tuple[str, int]] = []
    for field, arg in GRPC_TUNING.items():
        value = getattr(config, field)
        if value < 0:
            raise ConfigError(
                f"TransferConfig.{field} must be >= 0 (0: gRPC's default), got {value}"
            )
        if value:
            out.append((arg, value))
    frame = config.grpc_frame_bytes
    if frame and not MIN_FRAME_BYTES <= frame <= MAX_FRAME_BYTES:
        raise ConfigError(
            f"TransferConfig.grpc_frame_bytes must be 0 or {MIN_FRAME_BYTES}..{MAX_FRAME_BYTES} "
            f"(HTTP/2's frame size bounds), got {frame}"
        )
    if not config.grpc_bdp_probe:
        out.append(("grpc.http2.bdp_probe", 0))
    return out


MALLOC_TUNING: dict[int, int] = {
    -1: 32 * 1024 * 1024,  # M_TRIM_THRESHOLD: free memory kept at a heap's top before trimming
    -2: 8 * 1024 * 1024,  # M_TOP_PAD: extra bytes asked for whenever a heap grows
    -3: 32 * 1024 * 1024,  # M_MMAP_THRESHOLD: blocks below this come from the heaps, not mmap
}
"""glibc `mallopt` parameter -> value that `tune_malloc` sets."""

_malloc_tuned = False


def tune_malloc(config: TransferConfig) -> bool:
    """Apply `MALLOC_TUNING` to this process when `config.grpc_malloc_tune`; True if in force.

    Why: every message gRPC receives or sends is a fresh multi-MiB buffer
    (gRPC's read slices, the joined message, our encoded chunk). glibc trims
    freed memory at the top of a heap back to the kernel, so the next buffer
    is page-faulted and zeroed again: 60k-150k minor faults and 0.2-0.3 s of
    CPU per GiB received, mostly in gRPC's reads. Keeping it mapped removes
    that (measured: ~0.8 instead of 1.0-1.1 s of receiver CPU per GiB, +15-20%
    GB/s). It is process-wide (each heap keeps up to the trim threshold of
    freed memory), hence opt-in; the same as starting the process with
    ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` / ``MALLOC_MMAP_THRESHOLD_``.
    Not glibc (no ``mallopt``): nothing is changed and False is returned.
    """
    global _malloc_tuned
    if not config.grpc_malloc_tune:
        return _malloc_tuned
    if _malloc_tuned:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.warning("grpc_malloc_tune: this C library has no mallopt; left as it is")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in MALLOC_TUNING.items())
    _malloc_tuned = ok
    if not ok:
        log.warning("grpc_malloc_tune: mallopt refused a setting; the allocator is partly tuned")
    return ok


def _options(config: TransferConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", config.keepalive_ms),
        ("grpc.keepalive_timeout_ms", config.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", max(1, config.keepalive_ms // 2)),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
        *grpc_tuning_options(config),
    ]


def chunk_size(config: TransferConfig) -> int:
    """The data bytes per message: `chunk_bytes`, kept under `max_message_bytes`."""
    room = config.max_message_bytes - HEADER_RESERVE_BYTES
    if room < MIN_CHUNK_BYTES:
        raise ConfigError(
            f"max_message_bytes {config.max_message_bytes} is too small: it must leave "
            f"{MIN_CHUNK_BYTES} bytes of page data after {HEADER_RESERVE_BYTES} for headers"
        )
    return max(MIN_CHUNK_BYTES, min(config.chunk_bytes, room))


# ---------------------------------------------------------------- fetch limits


@dataclass(frozen=True, slots=True)
class FetchLimits:
    """What FetchPages streams may hold on one pool, from `TransferConfig` (`fetch_limits`).

    Pins are page references: a page asked for twice in one window is two.
    """

    window_pages: int  # one stream, pinned as it goes
    peer_pins: int  # one peer's streams together
    total_pins: int  # every stream together; the rest of the pool stays for requests
    stream_timeout_s: float
    idle_timeout_s: float
    pin_wait_s: float


def fetch_limits(config: TransferConfig, num_pages: int) -> FetchLimits:
    """The FetchPages limits of `config` on a pool of `num_pages` (page 0 included); the
    caps are shares of the usable pages, at least one pin each (`TransferConfig` checks
    the settings' ranges)."""
    usable = max(1, num_pages - 1)
    return FetchLimits(
        window_pages=config.fetch_window_pages,
        peer_pins=max(1, int(config.fetch_peer_pin_fraction * usable)),
        total_pins=max(1, int(config.fetch_pin_fraction * usable)),
        stream_timeout_s=config.fetch_stream_timeout_s,
        idle_timeout_s=config.fetch_idle_timeout_s,
        pin_wait_s=config.fetch_pin_wait_s,
    )


class PinBudget:
    """Counts the pins FetchPages streams hold, in all and per peer, against two caps.

    `take` grants what fits under both caps (possibly fewer than asked, 0 when
    either is reached); every granted pin is given back with `give`. Not
    thread-safe: the server uses it from its one event loop.
    """

    __slots__ = ("_by_peer", "held", "per_peer", "total")

    def __init__(self, total: int, per_peer: int) -> None:
        self.total = total
        self.per_peer = per_peer
        self.held = 0
        self._by_peer: dict[str, int] = {}

    def held_by(self, peer: str) -> int:
        return self._by_peer.get(peer, 0)

    def take(self, peer: str, want: int) -> int:
        """Grant up to `want` pins to `peer`; how many were granted."""
        n = max(0, min(want, self.total - self.held, self.per_peer - self.held_by(peer)))
        if n:
            self.held += n
            self._by_peer[peer] = self.held_by(peer) + n
        return n

    def give(self, peer: str, n: int) -> None:
        """Return `n` pins `take` granted to `peer`."""
        if not n:
            return
        left = self.held_by(peer) - n
        if left < 0 or n < 0:
            raise InvariantViolation(
                f"peer {peer} gives back {n} fetch pins but holds {self.held_by(peer)}"
            )
        self.held -= n
        if left:
            self._by_peer[peer] = left
        else:
            del self._by_peer[peer]


def peer_key(context: grpc.aio.ServicerContext) -> str:
    """Who a call comes from, for per-peer caps: its certificate's identity under mutual
    TLS, else its address without the port (on loopback every client is one peer)."""
    identities = context.peer_identities()
    if identities:
        return "cert:" + ",".join(bytes(i).decode(errors="replace") for i in identities)
    peer = context.peer() or "unknown"
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() and host not in ("ipv4", "ipv6") else peer


class _WriteFailed(Exception):
    """gRPC failed a FetchPages write: the call is broken (its cause says how)."""


class _StreamWatch:
    """Cancels a FetchPages handler at its deadline, or when one write waits too long.

    A write waits when the client does not read: gRPC's flow-control window
    and buffers are full. `reason` says which limit fired ("fetch_deadline",
    "fetch_idle"); None when the handler was cancelled for another reason
    (client gone, server stopping).
    """

    __slots__ = ("_deadline", "_idle", "_idle_s", "_loop", "_task", "_writing_since", "reason")

    def __init__(self, limits: FetchLimits) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - handlers always run in a task
            raise InvariantViolation("a FetchPages handler runs outside an asyncio task")
        self._task = task
        self._idle_s = limits.idle_timeout_s
        self._writing_since: float | None = None
        self.reason: str | None = None
        self._deadline = self._loop.call_later(
            limits.stream_timeout_s, self._fire, "fetch_deadline"
        )
        self._idle = self._loop.call_later(self._idle_s, self._check_idle)

    async def write(self, context: grpc.aio.ServicerContext, message: bytes) -> None:
        """`context.write`, timed; `_WriteFailed` when gRPC fails it (the call broke)."""
        self._writing_since = self._loop.time()
        try:
            await context.write(message)
        except Exception as exc:
            raise _WriteFailed from exc
        self._writing_since = None

    def _check_idle(self) -> None:
        since, now = self._writing_since, self._loop.time()
        if since is not None and now - since >= self._idle_s:
            self._fire("fetch_idle")
            return
        at = since + self._idle_s if since is not None else now + self._idle_s / 2
        self._idle = self._loop.call_at(at, self._check_idle)

    def _fire(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self._task.cancel()

    def close(self) -> None:
        self._deadline.cancel()
        self._idle.cancel()


class _FetchPins:
    """Pins pages for FetchPages streams within a `PinBudget`, on the server's event loop.

    A stream over a cap waits up to `fetch_pin_wait_s` for another stream to
    give pins back, then is refused with `PinLimitExceeded`.
    """

    __slots__ = ("_config", "_gauge", "_waiters", "budget", "limits", "service")

    def __init__(self, service: PageService, config: TransferConfig) -> None:
        self.service = service
        self._config = config
        self.limits = fetch_limits(config, service.pool.num_pages)
        self.budget = PinBudget(self.limits.total_pins, self.limits.peer_pins)
        self._waiters: set[asyncio.Future[None]] = set()
        self._gauge: Any = None

    def label(self, worker: str) -> None:
        """Report the pins held under `worker` in `FETCH_PINNED_PAGES`."""
        self._gauge = FETCH_PINNED_PAGES.labels(worker=worker)
        self._gauge.set(self.budget.held)

    async def pin(self, peer: str, hashes: Sequence[PageHash]) -> list[PageId | None]:
        """Pin the first n >= 1 of `hashes` (n: what the caps grant); None for a miss."""
        want = len(hashes)
        granted = self.budget.take(peer, want) or await self._wait(peer, want)
        try:
            ids = self.service.pin(hashes[:granted])
        except BaseException:
            self.budget.give(peer, granted)
            raise
        self.budget.give(peer, sum(1 for pid in ids if pid is None))
        self._changed()
        return ids

    def unpin(self, peer: str, ids: Sequence[PageId | None]) -> None:
        self.service.unpin(ids)
        self.budget.give(peer, sum(1 for pid in ids if pid is not None))
        self._changed()

    def _changed(self) -> None:
        if self._gauge is not None:
            self._gauge.set(self.budget.held)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self, peer: str, want: int) -> int:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.limits.pin_wait_s
        while True:
            granted = self.budget.take(peer, want)
            if granted:
                return granted
            left = end - loop.time()
            if left <= 0:
                raise PinLimitExceeded(self._refusal(peer))
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                pass
            finally:
                self._waiters.discard(waiter)

    def _refusal(self, peer: str) -> str:
        budget, cfg = self.budget, self._config
        waited = f"no pin came free within TransferConfig.fetch_pin_wait_s={cfg.fetch_pin_wait_s}s"
        if budget.held >= budget.total:
            return (
                f"FetchPages streams hold {budget.held} pinned pages, the cap for all peers "
                f"together (TransferConfig.fetch_pin_fraction={cfg.fetch_pin_fraction} of the "
                f"pool: {budget.total}; the rest stays free for requests); {waited}. Retry later"
            )
        return (
            f"FetchPages streams from {peer} hold {budget.held_by(peer)} pinned pages, the cap "
            f"per peer (TransferConfig.fetch_peer_pin_fraction={cfg.fetch_peer_pin_fraction} of "
            f"the pool: {budget.per_peer}); {waited}. Read or close the streams already open, "
            "or retry later"
        )


class _FetchStream:
    """One FetchPages stream: its peer, the pins it holds, the pages it has sent."""

    __slots__ = ("_held", "_pins", "peer", "sent")

    def __init__(self, pins: _FetchPins, peer: str) -> None:
        self._pins = pins
        self.peer = peer
        self.sent = 0
        self._held: list[PageId | None] = []

    async def pin(self, hashes: Sequence[PageHash]) -> list[PageId | None]:
        ids = await self._pins.pin(self.peer, hashes)
        self._held.extend(pid for pid in ids if pid is not None)
        return ids

    def release(self) -> None:
        """Give back every pin the stream holds (idempotent)."""
        held, self._held = self._held, []
        if held:
            self._pins.unpin(self.peer, held)


# ---------------------------------------------------------------------- server


class TransferServer:
    """`kvmesh.v1.KVWorker` + health over one `PageService`, on one asyncio loop.

    Use inside a running loop (``await start()`` ... ``await stop()``), or run it
    in a background thread with `ServerThread`. `page_delay_s` delays every
    streamed page (a test hook for slow peers; set it explicitly, never from env).
    """

    def __init__(
        self,
        service: PageService,
        config: TransferConfig | None = None,
        *,
        page_delay_s: float = 0.0,
    ) -> None:
        self.service = service
        self.config = config if config is not None else TransferConfig()
        self.page_delay_s = page_delay_s
        self._chunk_bytes = chunk_size(self.config)
        self._pins = _FetchPins(service, self.config)
        # The worker's id labels this server's metrics (its address when the
        # service has no name).
        self.name: str = getattr(service, "name", "")
        self._credentials = server_credentials(self.config)
        grpc_tuning_options(self.config)  # refuse impossible settings before anything starts
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self.port = 0

    @property
    def address(self) -> str:
        """``host:port`` clients dial (valid after `start`)."""
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def tls(self) -> bool:
        return self._credentials is not None

    async def start(self) -> str:
        """Bind (port 0: a free one) and start serving; returns the address."""
        if self._server is not None:
            raise InvalidInput(f"transfer server already started on {self.address}")
        tune_malloc(self.config)
        interceptors = (
            [TokenAuthInterceptor(self.config.auth_token)] if self.config.auth_token else []
        )
        server = grpc.aio.server(interceptors=interceptors, options=_options(self.config))
        server.add_generic_rpc_handlers((self._handlers(),))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        target = f"{self.config.host}:{self.config.port}"
        try:
            if self._credentials is not None:
                port = server.add_secure_port(target, self._credentials)
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as exc:
            raise TransportError(f"cannot bind the transfer server to {target}: {exc}") from None
        if port == 0:
            raise TransportError(f"cannot bind the transfer server to {target}")
        self.port = port
        self.name = self.name or self.address
        self._pins.label(self.name)
        await server.start()
        self._server = server
        await self.set_serving(True)
        log.info(
            "transfer server on %s (tls=%s, token=%s)", self.address, self.tls, bool(interceptors)
        )
        return self.address

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING (draining) on the standard health service."""
        if self._health is None:
            raise InvalidInput("transfer server is not started")
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Stop accepting calls; in-flight calls get `grace_s` to finish, then are cancelled."""
        server, self._server = self._server, None
        if server is None:
            return
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        await server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    # -- handlers ----------------------------------------------------------------

    def _handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                # Requests are parsed in the handlers so that undecodable bytes
                # become INVALID_ARGUMENT, not grpc's UNKNOWN.
                "Lookup": grpc.unary_unary_rpc_method_handler(
                    self._lookup, response_serializer=pb.LookupResponse.SerializeToString
                ),
                # FetchPages writes pre-encoded PageChunk bytes (see encode_chunk).
                "FetchPages": grpc.unary_stream_rpc_method_handler(self._fetch_pages),
                # PushPages hands raw bytes to decode_chunk itself, to map its errors.
                "PushPages": grpc.stream_unary_rpc_method_handler(
                    self._push_pages, response_serializer=pb.PushResponse.SerializeToString
                ),
            },
        )

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, exc: KVMeshError) -> None:
        await context.abort(
            grpc.StatusCode[exc.grpc_code],
            f"{type(exc).__name__}: {exc}",
            trailing_metadata=((ERROR_METADATA_KEY, type(exc).__name__),),
        )

    @staticmethod
    def _hashes(raw: Any) -> list[PageHash]:
        if len(raw) > MAX_HASHES_PER_CALL:
            raise InvalidInput(f"{len(raw)} page hashes in one call; at most {MAX_HASHES_PER_CALL}")
        return [check_hash(h) for h in raw]

    async def _lookup(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        try:
            request = _parse(pb.LookupRequest, raw)
            hashes = self._hashes(request.page_hashes)
            held = self.service.lookup(hashes)
        except KVMeshError as exc:
            await self._abort(context, exc)
            raise  # pragma: no cover - abort raises
        prefix = next((i for i, h in enumerate(held) if not h), len(held))
        return pb.LookupResponse(held=held, prefix_pages=prefix)

    async def _fetch_pages(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        try:
            request = _parse(pb.FetchRequest, raw)
            hashes = self._hashes(request.page_hashes)
        except KVMeshError as exc:
            await self._abort(context, exc)
            return  # pragma: no cover
        chunk = self._chunk_bytes
        if request.max_chunk_bytes:
            chunk = max(MIN_CHUNK_BYTES, min(chunk, request.max_chunk_bytes))
        stream = _FetchStream(self._pins, peer_key(context))
        watch = _StreamWatch(self._pins.limits)
        try:
            await self._stream_pages(hashes, chunk, context, stream, watch)
        except asyncio.CancelledError:
            if watch.reason is None:
                raise  # the client went away or the server is stopping: `finally` unpins
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            error = DeadlineExceeded(self._cut_short(watch.reason, stream, len(hashes)))
            await self._refuse(context, watch, stream, watch.reason, error)
        except PinLimitExceeded as exc:
            await self._refuse(context, watch, stream, "pin_cap", exc)
        except KVMeshError as exc:  # e.g. a page the store cannot export
            watch.close()
            stream.release()
            log.warning(
                "FetchPages from %s failed after %d pages: %s", stream.peer, stream.sent, exc
            )
            await self._abort(context, exc)
        except _WriteFailed as exc:
            # The call broke under a waiting write (the client cancelled or went
            # away; gRPC fails the write, no CancelledError): nobody is left to tell.
            log.debug("FetchPages from %s broke off: %r", stream.peer, exc.__cause__)
        else:
            stream.release()
            self._release_head_last(hashes)
        finally:
            # Runs on completion, error and cancellation (the task gets
            # CancelledError at its current await).
            watch.close()
            stream.release()

    async def _stream_pages(
        self,
        hashes: list[PageHash],
        chunk: int,
        context: grpc.aio.ServicerContext,
        stream: _FetchStream,
        watch: _StreamWatch,
    ) -> None:
        """Send every page, a window of them pinned at a time and released once its pages
        are written (their bytes are in gRPC's buffers)."""
        window = self._pins.limits.window_pages
        index = 0
        while index < len(hashes):
            for page_id in await stream.pin(hashes[index : index + window]):
                if self.page_delay_s:
                    await asyncio.sleep(self.page_delay_s)
                for message in self._page_messages(index, hashes[index], page_id, chunk):
                    await watch.write(context, message)
                index += 1
                stream.sent = index
            stream.release()

    def _release_head_last(self, hashes: Sequence[PageHash]) -> None:
        """Queue the served pages for eviction tail-first, as a request's pages are.

        Windows were released in stream order, so the head of a prefix would be
        evicted first; touching the pages once more and freeing them in reverse,
        under one hold of the lock (nobody sees them pinned), puts the head last.
        """
        pool = self.service.pool
        with self.service.lock:
            pages = [p for p in map(pool.get_cached_page, hashes) if p is not None]
            pool.touch(pages)
            pool.free_pages(reversed(pages))

    def _cut_short(self, reason: str, stream: _FetchStream, asked: int) -> str:
        limits, peer, sent = self._pins.limits, stream.peer, stream.sent
        if reason == "fetch_idle":
            return (
                f"FetchPages from {peer} stopped: the client read nothing for "
                f"{limits.idle_timeout_s}s (TransferConfig.fetch_idle_timeout_s) after {sent} of "
                f"{asked} pages; its pins are released. Read the stream as it comes"
            )
        return (
            f"FetchPages from {peer} ran past its server-side deadline of "
            f"{limits.stream_timeout_s}s (TransferConfig.fetch_stream_timeout_s) after {sent} of "
            f"{asked} pages; its pins are released. Ask for fewer pages per call"
        )

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext,
        watch: _StreamWatch,
        stream: _FetchStream,
        reason: str,
        error: KVMeshError,
    ) -> None:
        """End a stream a limit cut short: pins first (sending the status may wait on a
        client that does not read), then the metric, the log line and the status."""
        watch.close()
        stream.release()
        TRANSFER_REFUSED.labels(worker=self.name, reason=reason).inc()
        log.warning("%s", error)
        await self._abort(context, error)

    def _page_messages(
        self, index: int, page_hash: PageHash, page_id: PageId | None, chunk: int
    ) -> Iterator[bytes]:
        info = None
        if page_id is not None:
            try:
                info = self.service.page_info(page_id)
            except InvalidInput:  # evicted by hash between pin and now: cannot vouch for it
                info = None
        if page_id is None or info is None or info.page_hash != page_hash:
            missing = pb.PageHeader(page_hash=page_hash)
            return iter((encode_chunk(index, 0, b"", header=missing, missing=True),))
        blob = self.service.export(page_id)
        return iter_page_chunks(index, page_header(info, blob), memoryview(blob.data), chunk)

    async def _push_pages(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> pb.PushResponse:
        assembler = PageAssembler(self.service.store.page_nbytes)
        inserted: list[bool] = []
        pusher = "grpc:" + peer_key(context)
        try:
            # Refused before a byte is read: pushes come only for a request routed here.
            receiver = self.service.receiving_push(_push_ticket(context), pusher)
            async for raw in request_iterator:
                page = assembler.add(decode_chunk(raw))
                if isinstance(page, IncomingPage):
                    inserted.extend(receiver.insert_many([page]))
            assembler.finish()
        except KVMeshError as exc:
            log.warning(
                "PushPages from %s refused after %d pages: %s", context.peer(), len(inserted), exc
            )
            # Read what the client already sent (bounded) before answering: closing a call
            # with its messages unread can reach the client as INTERNAL, not as this error.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(_drain(request_iterator, PUSH_DRAIN_MESSAGES), 0.2)
            await self._abort(context, exc)
        return pb.PushResponse(inserted=inserted)


async def _drain(messages: AsyncIterator[bytes], limit: int) -> None:
    """Read and drop up to `limit` messages of a refused stream."""
    n = 0
    async for _ in messages:
        n += 1
        if n >= limit:
            return


def _push_ticket(context: grpc.aio.ServicerContext) -> bytes:
    """The push grant's ticket from the call's metadata (empty when absent or not hex)."""
    for key, value in context.invocation_metadata() or ():
        if key == PUSH_TICKET_KEY and isinstance(value, str):
            try:
                return bytes.fromhex(value)
            except ValueError:
                return b""
    return b""


def _parse(cls: Any, raw: bytes) -> Any:
    """Parse a request message; malformed bytes are the caller's error (InvalidInput)."""
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        raise InvalidInput(f"{cls.__name__} is not valid protobuf: {exc}") from exc


class ServerThread:
    """Runs a `TransferServer` on its own event loop in a daemon thread.

    For callers without a loop of their own (Ray actors, sync code, tests)::

        with ServerThread(service, config) as srv:
            peer = srv.address
    """

    def __init__(
        self,
        service: PageService,
        config: TransferConfig | None = None,
        *,
        page_delay_s: float = 0.0,
    ) -> None:
        self.server = TransferServer(service, config, page_delay_s=page_delay_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvmesh-transfer-server", daemon=True
        )

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the loop thread and the server; returns the address."""
        self._thread.start()
        try:
            return asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(
                timeout_s
            )
        except BaseException:
            self._shutdown_loop()
            raise

    def set_serving(self, serving: bool, timeout_s: float = 5.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.set_serving(serving), self._loop).result(
            timeout_s
        )

    def stop(self, grace_s: float | None = 0.5, timeout_s: float = 10.0) -> None:
        """Stop the server and the loop thread (idempotent)."""
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self._loop).result(
                timeout_s
            )
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
