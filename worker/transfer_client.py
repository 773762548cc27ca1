"""Client side of page transfer: `PeerClient` (grpc.aio) and `SyncPeerClient`.

Every call has a deadline (`TransferConfig.deadline_s` unless given). Failures
raise kvmesh errors that name the peer and what to do: `DeadlineExceeded`,
`Unauthenticated`, `ChecksumMismatch`, `MessageTooLarge`, `TransportError`
(and the server's own `KVMeshError` class when it sent one). Retries are
bounded, jittered and exponential, only on ``UNAVAILABLE`` and only for
idempotent calls (Lookup, FetchPages, Health), never PushPages; a retried
fetch asks again only for the pages it has not received.

Fetching (`fetch_pages`) splits the hashes over `fetch_streams` concurrent
streams, interleaved (page i on stream i mod k), each on its own connection,
and hands the pages to the caller strictly in request order; each page is
checked (framing, dtype, shape, size, checksum, and that it is the page asked
for) before it is handed over. If the peer dies mid-stream, the pages handed
over so far are complete and valid, and none after the first gap is.
`pull_into` inserts them into a local `PageService` as they come, one copy
each (message -> KV tensor), checked before anything in the pool changes.

Three fetch engines, one contract. `PeerClient` (grpc.aio) does all the
Python-side work of every stream on its event loop's one thread: grpcio's
copies out of its buffers, the checks, the inserts. `SyncFetcher`
(``TransferConfig.grpc_sync_fetch``, for `SyncPeerClient`) runs each stream
as a blocking call on its own thread and channel and lands each checked page
in a reserved pool page from that thread (numpy copies and xxh3 release the
GIL). With ``TransferConfig.grpc_zero_copy`` (the default), a pull into a pool
(`SyncPeerClient.pull_into`) reads each stream with
`kvmesh.worker.grpc_wire.WireCall` instead: the same gRPC call to the same
server, but each page's bytes go from the socket straight into a reserved
pool page (`_Lander`: header checked first, bytes hashed as they land, the
checksum compared at the page's end), so the receiver does the kernel's copy
and one xxh3 pass per byte instead of grpcio's five passes (a GPU pool's
pages land in host memory and are copied in once checked). A `WireCall`
opens its own connection (~2 ms per call on loopback), so pulls smaller than
``grpc_zero_copy_min_bytes`` (4 MiB) stay on grpcio's reused channels: on
this machine 4 x 32 KiB pages took 7.5 ms zero-copy against 4.2 ms over
grpcio, 32 x 1 MiB pages 42 ms against 48 ms. On the 2-core
benchmark machine that moved `kvmesh bench transfer` from 28-38% of the raw
socket to 48-66% (1.4-2.0 GB/s); see `kvmesh.worker.transfer_server` for the
sender's side, which is now the bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.config import TransferConfig
from kvmesh.errors import (
    ChecksumMismatch,
    DeadlineExceeded,
    InvalidInput,
    InvariantViolation,
    KVMeshError,
    MessageTooLarge,
    PageFormatError,
    TransportError,
    Unauthenticated,
    UnknownHash,
)
from kvmesh.grpc_security import ERROR_METADATA_KEY, client_tls_material
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.types import PageHash
from kvmesh.worker.grpc_tuning import grpc_tuning_options, tune_malloc
from kvmesh.worker.grpc_wire import WireCall, tls_context
from kvmesh.worker.kv_store import DTYPES, checksum
from kvmesh.worker.page_codec import (
    PUSH_TICKET_KEY,
    SERVICE_NAME,
    PageAssembler,
    chunk_size,
    decode_chunk,
    first_chunk_header,
    incoming_page,
    iter_page_chunks,
)
from kvmesh.worker.page_service import (
    IncomingPage,
    PageReceiver,
    PageService,
    Reservation,
    check_hash,
)

T = TypeVar("T")

_METHOD = f"/{SERVICE_NAME}/"
SINGLE_THREADED_UNARY_STREAM = "SingleThreadedUnaryStream"
"""`grpc.experimental.ChannelOptions.SingleThreadedUnaryStream`: a server stream's messages
are taken off gRPC's queue by the thread that iterates it, not handed over by a per-channel
spin thread (one thread switch less per message; grpcio notes an appreciable speed-up)."""
OnPage = Callable[[int, IncomingPage], None]
"""Called with (request index, page) for every received page, in request order."""


def _all_errors(cls: type[KVMeshError]) -> dict[str, type[KVMeshError]]:
    out = {cls.__name__: cls}
    for sub in cls.__subclasses__():
        out.update(_all_errors(sub))
    return out


ERRORS_BY_NAME = _all_errors(KVMeshError)
"""Registry of kvmesh error classes by name, for the server's ``kvmesh-error`` metadata."""

ERRORS_BY_CODE: dict[grpc.StatusCode, type[KVMeshError]] = {
    grpc.StatusCode.UNAVAILABLE: TransportError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.DATA_LOSS: ChecksumMismatch,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MessageTooLarge,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
    grpc.StatusCode.NOT_FOUND: UnknownHash,
}
"""A gRPC status without kvmesh metadata (transport-level failures) -> the error raised."""

_HINTS: dict[type[KVMeshError], str] = {
    TransportError: "check that the peer is running and reachable (kvmesh status)",
    DeadlineExceeded: "the peer is slow or stuck; retry later or raise TransferConfig.deadline_s",
    Unauthenticated: "use the cluster's auth_token and a client certificate from its CA",
    MessageTooLarge: "use the same max_message_bytes / chunk_bytes on every worker",
    ChecksumMismatch: "the page was corrupted on the way; fetch it again",
}


def translate(err: grpc.aio.AioRpcError | grpc.RpcError, what: str, address: str) -> KVMeshError:
    """The kvmesh error for a failed call: the server's class if it sent one, else by status."""
    code = err.code()
    details = err.details() or ""
    name = None
    for key, value in err.trailing_metadata() or ():
        if key == ERROR_METADATA_KEY:
            name = value if isinstance(value, str) else bytes(value).decode(errors="replace")
    cls = ERRORS_BY_NAME.get(name or "")
    if cls is None or cls.grpc_code != code.name:
        cls = ERRORS_BY_CODE.get(code, TransportError)
    hint = next((_HINTS[c] for c in cls.__mro__ if c in _HINTS), "")
    message = f"{what} to peer {address} failed ({code.name}): {details}"
    return cls(f"{message}; {hint}" if hint else message)


def channel_credentials(config: TransferConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials for dialing peers (`client_tls_material`), or None for plaintext."""
    root, key, cert = client_tls_material(config)
    if root is None and cert is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=root, private_key=key, certificate_chain=cert
    )


def _channel_options(config: TransferConfig) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", config.keepalive_ms),
        ("grpc.keepalive_timeout_ms", config.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),  # retries are ours: bounded, idempotent calls only
        ("grpc.use_local_subchannel_pool", 1),  # one connection per channel
    ]
    options.extend(grpc_tuning_options(config))
    if config.tls_server_name:
        options.append(("grpc.ssl_target_name_override", config.tls_server_name))
    return options


@dataclass(frozen=True, slots=True)
class FetchResult:
    """What a fetch returned: the pages (in request order) and the hashes the peer lacks.

    `pages` is empty when the pages went to an ``on_page`` callback instead.
    """

    pages: tuple[IncomingPage, ...]
    missing: tuple[PageHash, ...]  # in request order
    received: int


def verify_page(
    page: IncomingPage, expected: PageHash, address: str, *, with_checksum: bool = True
) -> None:
    """Check a received page on its own: the hash asked for, a consistent format, its checksum.

    `with_checksum=False` leaves the checksum to a consumer that checks it anyway
    (`PageService.insert_many`), so the bytes are hashed once.
    """
    if page.page_hash != expected:
        raise InvalidInput(
            f"peer {address} sent page {page.page_hash.hex()[:16]} where "
            f"{expected.hex()[:16]} was asked for; the peer is faulty"
        )
    blob = page.blob
    itemsize = DTYPES[blob.dtype].itemsize
    if math.prod(blob.shape) * itemsize != blob.nbytes or not blob.shape:
        raise PageFormatError(
            f"peer {address} sent page {expected.hex()[:16]} with {blob.nbytes} bytes, "
            f"which is not {blob.dtype} {list(blob.shape)}"
        )
    if not with_checksum:
        return
    actual = checksum(blob.data)
    if actual != blob.checksum:
        raise ChecksumMismatch(
            f"page {expected.hex()[:16]} from peer {address} hashes to {actual:#018x}, "
            f"header says {blob.checksum:#018x}: corrupted in transit; fetch it again"
        )


def read_fetched(
    assembler: PageAssembler,
    raw: bytes,
    indices: Sequence[int],
    hashes: Sequence[PageHash],
    address: str,
) -> tuple[int, IncomingPage | None] | None:
    """Feed one FetchPages message of a stream asking for ``hashes[i] for i in indices``.

    None until a page is complete; then (its request index, the page, or None
    when the peer reported it missing). A "missing" marker for another hash
    than the one asked for is the peer's fault (`InvalidInput`).
    """
    got = assembler.add(decode_chunk(raw))
    if got is None:
        return None
    index = indices[assembler.next_index - 1]
    if isinstance(got, IncomingPage):
        return index, got
    if got != hashes[index]:
        raise InvalidInput(
            f"peer {address} reported {got.hex()[:16]} missing where "
            f"{hashes[index].hex()[:16]} was asked for; the peer is faulty"
        )
    return index, None


def take_fetched(
    assembler: PageAssembler,
    raw: bytes,
    indices: Sequence[int],
    hashes: Sequence[PageHash],
    address: str,
    order: _Reorder | _Ordered,
    check: Callable[[IncomingPage, PageHash], Any],
) -> None:
    """One FetchPages message of a grpcio stream: a finished page, `check`ed (what it returns
    is handed on), or a missing marker goes to `order`; an unfinished page waits for more."""
    done = read_fetched(assembler, raw, indices, hashes, address)
    if done is None:
        return
    index, page = done
    if page is None:
        order.put(index, None, hashes[index])
    else:
        order.put(index, check(page, hashes[index]), page.page_hash)


def end_fetch_stream(assembler: PageAssembler, asked: int, address: str) -> None:
    """After a FetchPages stream's last message: every page asked for must have come."""
    assembler.finish()
    if assembler.next_index != asked:
        raise TransportError(
            f"peer {address} ended FetchPages after {assembler.next_index} of "
            f"{asked} pages; the peer is faulty"
        )


def _in_request_order(missing: list[tuple[int, PageHash]]) -> tuple[PageHash, ...]:
    """Missing hashes as the caller asked for them (streams report them as they come)."""
    return tuple(h for _, h in sorted(missing, key=lambda m: m[0]))


class _Reorder:
    """Hands pages to the caller in request order as the streams deliver them."""

    __slots__ = ("deliver", "missing", "next", "pages", "ready")

    def __init__(self, deliver: OnPage) -> None:
        self.deliver = deliver
        self.ready: dict[int, IncomingPage | None] = {}
        self.next = 0
        self.missing: list[tuple[int, PageHash]] = []  # (request index, hash)
        self.pages = 0

    def put(self, index: int, page: IncomingPage | None, page_hash: PageHash) -> None:
        if page is None:
            self.missing.append((index, page_hash))
        self.ready[index] = page
        while self.next in self.ready:
            got = self.ready.pop(self.next)
            if got is not None:
                self.deliver(self.next, got)
                self.pages += 1
            self.next += 1


class PeerClient:
    """Async client for one peer's `kvmesh.v1.KVWorker`; use in one event loop.

    `rng` and `sleep` are injectable for deterministic retry tests.
    """

    def __init__(
        self,
        address: str,
        config: TransferConfig | None = None,
        *,
        rng: random.Random | None = None,
        sleep: Callable[[float], Coroutine[Any, Any, None]] = asyncio.sleep,
    ) -> None:
        self.address = address
        self.config = config if config is not None else TransferConfig()
        self._rng = rng if rng is not None else random.Random()
        self._sleep = sleep
        self._credentials = channel_credentials(self.config)
        self._options = _channel_options(self.config)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {self.config.auth_token}"),)
            if self.config.auth_token
            else ()
        )
        self._chunk_bytes = chunk_size(self.config)
        self._channels: list[grpc.aio.Channel] = []
        tune_malloc(self.config)

    # -- channels ---------------------------------------------------------------

    def _channel(self, i: int = 0) -> grpc.aio.Channel:
        while len(self._channels) <= i:
            if self._credentials is not None:
                ch = grpc.aio.secure_channel(self.address, self._credentials, self._options)
            else:
                ch = grpc.aio.insecure_channel(self.address, self._options)
            self._channels.append(ch)
        return self._channels[i]

    async def close(self) -> None:
        channels, self._channels = self._channels, []
        for ch in channels:
            await ch.close()

    async def __aenter__(self) -> PeerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- retries ------------------------------------------------------------------

    def _deadline(self, deadline_s: float | None) -> float:
        timeout = self.config.deadline_s if deadline_s is None else deadline_s
        if timeout <= 0:
            raise InvalidInput(f"deadline must be positive, got {timeout}")
        return asyncio.get_running_loop().time() + timeout

    def _remaining(self, end: float, what: str) -> float:
        left = end - asyncio.get_running_loop().time()
        if left <= 0:
            raise DeadlineExceeded(
                f"{what} to peer {self.address} ran out of its deadline; {_HINTS[DeadlineExceeded]}"
            )
        return left

    async def _call(
        self,
        what: str,
        attempt: Callable[[float], Coroutine[Any, Any, T]],
        end: float,
        *,
        idempotent: bool,
    ) -> T:
        """Run `attempt(timeout)`; on UNAVAILABLE retry (idempotent only) within `end`."""
        tries = 0
        while True:
            timeout = self._remaining(end, what)
            try:
                return await attempt(timeout)
            except grpc.aio.AioRpcError as err:
                retry = (
                    idempotent
                    and err.code() == grpc.StatusCode.UNAVAILABLE
                    and tries < self.config.retries
                )
                if not retry:
                    raise translate(err, what, self.address) from None
            backoff = self.config.retry_backoff_s * (2**tries) * (0.5 + self._rng.random())
            tries += 1
            await self._sleep(min(backoff, max(0.0, self._remaining(end, what) - 0.001)))

    # -- calls --------------------------------------------------------------------

    async def lookup(
        self, hashes: Sequence[PageHash], *, deadline_s: float | None = None
    ) -> list[bool]:
        """For each hash, whether the peer holds it (in order)."""
        call = self._channel().unary_unary(
            _METHOD + "Lookup",
            request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupResponse.FromString,
        )
        request = pb.LookupRequest(page_hashes=list(hashes))

        async def attempt(timeout: float) -> list[bool]:
            reply = await call(request, timeout=timeout, metadata=self._metadata)
            return list(reply.held)

        held = await self._call("Lookup", attempt, self._deadline(deadline_s), idempotent=True)
        if len(held) != len(hashes):
            raise TransportError(
                f"peer {self.address} answered {len(held)} lookups for {len(hashes)} hashes"
            )
        return held

    async def health(self, *, deadline_s: float | None = None, service: str = SERVICE_NAME) -> str:
        """The peer's standard health status: ``SERVING``, ``NOT_SERVING``, ..."""
        stub = health_pb2_grpc.HealthStub(self._channel())

        async def attempt(timeout: float) -> str:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout,
                metadata=self._metadata,
            )
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

        return await self._call("Health", attempt, self._deadline(deadline_s), idempotent=True)

    async def fetch_pages(
        self,
        hashes: Sequence[PageHash],
        *,
        deadline_s: float | None = None,
        on_page: OnPage | None = None,
        streams: int | None = None,
        with_checksum: bool = True,
    ) -> FetchResult:
        """Fetch the pages for `hashes`; each is verified before it is handed over.

        With `on_page`, pages go to it in request order as they arrive (and are
        not kept); otherwise they are returned. On failure this raises; pages
        already handed to `on_page` are valid and complete, later ones are not
        handed over. `with_checksum=False` is for an `on_page` that verifies
        checksums itself.
        """
        hashes = [check_hash(h) for h in hashes]
        kept: list[IncomingPage] = []
        deliver: OnPage = on_page if on_page is not None else (lambda _i, p: kept.append(p))
        order = _Reorder(deliver)
        end = self._deadline(deadline_s)
        k = max(1, min(streams or self.config.fetch_streams, len(hashes) or 1))
        todo = list(range(len(hashes)))
        tries = 0
        while todo:
            shards = [todo[s::k] for s in range(k)]
            shards = [s for s in shards if s]
            tasks = [
                asyncio.ensure_future(
                    self._fetch_stream(i, shard, hashes, order, end, with_checksum)
                )
                for i, shard in enumerate(shards)
            ]
            try:
                await asyncio.gather(*tasks)
            except grpc.aio.AioRpcError as err:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                retry = err.code() == grpc.StatusCode.UNAVAILABLE and tries < self.config.retries
                if not retry:
                    raise translate(err, "FetchPages", self.address) from None
                backoff = self.config.retry_backoff_s * (2**tries) * (0.5 + self._rng.random())
                tries += 1
                await self._sleep(min(backoff, self._remaining(end, "FetchPages")))
                # Ask again only for what has not arrived (valid pages past a gap are kept).
                todo = [i for i in range(order.next, len(hashes)) if i not in order.ready]
                continue
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            todo = []
        return FetchResult(tuple(kept), _in_request_order(order.missing), order.pages)

    async def _fetch_stream(
        self,
        stream: int,
        indices: list[int],
        hashes: list[PageHash],
        order: _Reorder,
        end: float,
        with_checksum: bool,
    ) -> None:
        timeout = self._remaining(end, "FetchPages")
        call = self._channel(stream).unary_stream(
            _METHOD + "FetchPages",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=None,  # raw bytes: decode_chunk's errors stay kvmesh errors
        )
        request = pb.FetchRequest(
            page_hashes=[hashes[i] for i in indices], max_chunk_bytes=self._chunk_bytes
        )
        responses = call(request, timeout=timeout, metadata=self._metadata)
        assembler = PageAssembler(allow_missing=True)
        try:

            def check(page: IncomingPage, expected: PageHash) -> IncomingPage:
                verify_page(page, expected, self.address, with_checksum=with_checksum)
                return page

            async for raw in responses:
                take_fetched(assembler, raw, indices, hashes, self.address, order, check)
            end_fetch_stream(assembler, len(indices), self.address)
        finally:
            responses.cancel()

    async def push_pages(
        self, pages: Sequence[IncomingPage], ticket: bytes, *, deadline_s: float | None = None
    ) -> list[bool]:
        """Push pages for the peer to check and cache; per page: True new, False already held.

        `ticket` is the grant the peer handed out for this request's pages
        (`PageService.grants.grant` there); without a live one the peer refuses
        the push (`PermissionDenied`). Never retried (not idempotent from the caller's view: a retry after a
        partial success would be indistinguishable). On failure the pages the
        peer finished before the error stay cached there, the rest do not.
        """
        call = self._channel().stream_unary(
            _METHOD + "PushPages",
            request_serializer=None,
            response_deserializer=pb.PushResponse.FromString,
        )
        chunk = self._chunk_bytes

        def messages() -> Iterator[bytes]:
            for i, page in enumerate(pages):
                header = pb.PageHeader(
                    page_hash=page.page_hash,
                    parent_hash=page.parent_hash or b"",
                    token_ids=page.token_ids,
                    dtype=page.blob.dtype,
                    shape=page.blob.shape,
                    nbytes=page.blob.nbytes,
                    checksum=page.blob.checksum,
                )
                if page.lora_id is not None:
                    header.lora_id = page.lora_id
                yield from iter_page_chunks(i, header, memoryview(page.blob.data), chunk)

        metadata = (*self._metadata, (PUSH_TICKET_KEY, ticket.hex()))

        async def attempt(timeout: float) -> list[bool]:
            # Written one message at a time: when the peer refuses mid-stream, a write
            # fails and the call's own status (the peer's error) is what is raised.
            stream = call(timeout=timeout, metadata=metadata)
            try:
                for message in messages():
                    await stream.write(message)
                await stream.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the call is over: awaiting it below raises its status
            reply = await stream
            return list(reply.inserted)

        return await self._call("PushPages", attempt, self._deadline(deadline_s), idempotent=False)

    async def push_from(
        self,
        service: PageService,
        hashes: Sequence[PageHash],
        ticket: bytes,
        *,
        deadline_s: float | None = None,
    ) -> list[bool]:
        """Push pages held by a local `service` (prefill -> decode); pinned while sent.

        Raises `UnknownHash` (nothing sent) when a hash is not held locally.
        """
        ids = service.pin(hashes)
        try:
            absent = [h.hex()[:16] for h, pid in zip(hashes, ids, strict=True) if pid is None]
            if absent:
                raise UnknownHash(
                    f"cannot push {len(absent)} pages this worker does not hold: {absent[:4]}"
                )
            pages = []
            for pid in ids:
                if pid is None:  # pragma: no cover - excluded above
                    continue
                info = service.page_info(pid)
                pages.append(
                    IncomingPage(
                        info.page_hash,
                        info.parent_hash,
                        info.token_ids,
                        service.export(pid),
                        info.lora_id,
                    )
                )
            return await self.push_pages(pages, ticket, deadline_s=deadline_s)
        finally:
            service.unpin(ids)

    async def pull_into(
        self, service: PageReceiver, hashes: Sequence[PageHash], *, deadline_s: float | None = None
    ) -> int:
        """Fetch `hashes` and insert each page into `service` as it arrives; returns pages inserted.

        Pages the local pool already holds are skipped (not counted). On
        failure (peer died, deadline, bad page) the error is raised; the pages
        inserted before it are complete and valid, no later page is inserted.
        """
        inserted = 0

        def insert(_index: int, page: IncomingPage) -> None:
            nonlocal inserted
            try:
                inserted += service.insert_many([page])[0]
            except ChecksumMismatch as exc:
                raise ChecksumMismatch(f"page from peer {self.address}: {exc}") from None

        await self.fetch_pages(hashes, deadline_s=deadline_s, on_page=insert, with_checksum=False)
        return inserted


async def pull_into(
    service: PageReceiver,
    peer_address: str,
    hashes: Sequence[PageHash],
    *,
    config: TransferConfig | None = None,
    deadline_s: float | None = None,
) -> int:
    """One-shot `PeerClient.pull_into` over a fresh connection to `peer_address`."""
    async with PeerClient(peer_address, config) as client:
        return await client.pull_into(service, hashes, deadline_s=deadline_s)


@dataclass(frozen=True, slots=True)
class _Landed:
    """A page checked and copied into a reserved pool page by its stream; to be committed."""

    reservation: Reservation
    page: IncomingPage


_Item = IncomingPage | _Landed


class _Ordered:
    """Hands pages to `deliver` in request order as concurrent streams finish them.

    Thread-safe; `deliver` runs under the lock, so one call at a time, in order.
    A page whose predecessors are still on the way waits here. Once closed (an
    error, or the end of the fetch) nothing more is delivered, and the reserved
    pool pages of waiting pages are given back.
    """

    __slots__ = ("_lock", "closed", "deliver", "missing", "next", "pages", "ready", "service")

    def __init__(self, deliver: Callable[[int, _Item], None], service: PageReceiver | None) -> None:
        self.deliver = deliver
        self.service = service
        self._lock = threading.Lock()
        self.ready: dict[int, _Item | None] = {}
        self.next = 0
        self.missing: list[tuple[int, PageHash]] = []  # (request index, hash)
        self.pages = 0
        self.closed = False

    def put(self, index: int, item: _Item | None, page_hash: PageHash) -> None:
        with self._lock:
            if self.closed:
                self._drop([item])
                return
            if item is None:
                self.missing.append((index, page_hash))
            self.ready[index] = item
            while self.next in self.ready:
                got = self.ready.pop(self.next)
                if got is not None:
                    try:
                        self.deliver(self.next, got)
                    except BaseException:
                        self.closed = True
                        self._drop([got, *self.ready.values()])
                        self.ready.clear()
                        raise
                    self.pages += 1
                self.next += 1

    def todo(self, n: int) -> list[int]:
        """The indices below `n` that no stream has handed in yet."""
        with self._lock:
            return [i for i in range(self.next, n) if i not in self.ready]

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._drop(list(self.ready.values()))
            self.ready.clear()

    def _drop(self, items: Sequence[_Item | None]) -> None:
        held = [it.reservation for it in items if isinstance(it, _Landed)]
        if held and self.service is not None:
            self.service.release(held)


class _Lander:
    """Receives one zero-copy stream's pages straight into reserved pool pages (`WireCall`;
    on a device store, into host memory, copied to the reserved page once checked).

    Each page's header is checked first (the hash asked for, dtype, shape and
    size for this store, the hash chain when token ids come with it), so a
    refused page reserves, evicts and writes nothing; then its data chunks are
    read from the socket into the reserved page and hashed (xxh3, streaming)
    while still in cache, and the checksum is compared when the page is
    complete. A page the pool cannot reserve (held already, being received by
    another transfer, no room) lands in a scratch buffer and goes to
    `PageService.insert_many` in order instead.
    """

    __slots__ = (
        "_dst",
        "_filled",
        "_hasher",
        "_page",
        "_res",
        "_upload",
        "address",
        "hashes",
        "indices",
        "next",
        "order",
        "service",
    )

    def __init__(
        self,
        service: PageReceiver,
        indices: list[int],
        hashes: list[PageHash],
        order: _Ordered,
        address: str,
    ) -> None:
        self.service = service
        self.indices = indices
        self.hashes = hashes
        self.order = order
        self.address = address
        self.next = 0  # position in `indices` of the page on the way
        self._page: IncomingPage | None = None
        self._res: Reservation | None = None
        self._dst = memoryview(b"")
        self._filled = 0
        self._upload = False
        self._hasher = xxhash.xxh3_64()

    def target(self, meta: pb.PageChunk, nbytes: int) -> memoryview:
        if self._page is None:
            if not self._begin(meta):
                if nbytes:
                    raise InvalidInput(f"peer {self.address} sent data with a missing page")
                return memoryview(bytearray())
        elif meta.page_index != self.next or meta.HasField("header") or meta.missing:
            raise InvalidInput(
                f"page {self.next} from peer {self.address} is incomplete ({self._filled} of "
                f"{len(self._dst)} bytes) but a chunk for page {meta.page_index} arrived"
            )
        if meta.offset != self._filled or self._filled + nbytes > len(self._dst):
            raise InvalidInput(
                f"page {self.next} from peer {self.address}: chunk at offset {meta.offset} with "
                f"{nbytes} bytes does not continue the {self._filled} of {len(self._dst)} received"
            )
        return self._dst[self._filled : self._filled + nbytes]

    def _begin(self, meta: pb.PageChunk) -> bool:
        """Check a page's first chunk and pick where its bytes go; False for a missing page."""
        if meta.page_index != self.next or self.next >= len(self.indices):
            raise InvalidInput(
                f"peer {self.address} sent page {meta.page_index} where page {self.next} of "
                f"{len(self.indices)} was expected; the peer is faulty"
            )
        index = self.indices[self.next]
        expected = self.hashes[index]
        if meta.missing:
            if check_hash(meta.header.page_hash) != expected:
                raise InvalidInput(
                    f"peer {self.address} reported {meta.header.page_hash.hex()[:16]} missing "
                    f"where {expected.hex()[:16]} was asked for; the peer is faulty"
                )
            self.next += 1
            self.order.put(index, None, expected)
            return False
        store = self.service.store
        header = first_chunk_header(meta, store.page_nbytes)
        nbytes = header.nbytes
        probe = incoming_page(header, _placeholder(nbytes))
        verify_page(probe, expected, self.address, with_checksum=False)
        self.service.check(probe, with_checksum=False)  # format and hash chain, no bytes yet
        res = self.service.reserve([expected])[0]
        dst = store.page_buffer(res.page.page_id) if res is not None else None
        self._upload = res is not None and dst is None  # a device store: copied in at the end
        if dst is None:
            dst = np.empty(nbytes, dtype=np.uint8).data
        self._res = res
        self._page = dataclasses.replace(probe, blob=dataclasses.replace(probe.blob, data=dst))
        self._dst = dst
        self._filled = 0
        self._hasher.reset()
        return True

    def landed(self, _meta: pb.PageChunk, data: memoryview) -> None:
        page = self._page
        if page is None:
            return
        self._hasher.update(data)
        self._filled += len(data)
        if self._filled < len(self._dst):
            return
        res, self._page, self._res = self._res, None, None
        index = self.indices[self.next]
        self.next += 1
        actual = self._hasher.intdigest()
        if actual == page.blob.checksum and res is not None and self._upload:
            try:
                self.service.store.import_page(res.page.page_id, page.blob, verified=True)
            except BaseException:
                self.service.release([res])
                raise
        elif actual != page.blob.checksum:
            if res is not None:
                self.service.release([res])
            raise ChecksumMismatch(
                f"page {page.page_hash.hex()[:16]} from peer {self.address} hashes to "
                f"{actual:#018x}, header says {page.blob.checksum:#018x}: corrupted in transit; "
                "fetch it again"
            )
        self.order.put(index, _Landed(res, page) if res is not None else page, page.page_hash)

    def finish(self) -> None:
        """After the call's OK status: every page asked for must have come, whole."""
        if self._page is not None or self.next != len(self.indices):
            raise TransportError(
                f"peer {self.address} ended FetchPages after {self.next} of "
                f"{len(self.indices)} pages; the peer is faulty"
            )

    def abort(self) -> None:
        """Give back the reserved page of a page left incomplete (idempotent)."""
        res, self._res, self._page = self._res, None, None
        if res is not None:
            self.service.release([res])


_PLACEHOLDERS: dict[int, bytes] = {}


def _placeholder(nbytes: int) -> bytes:
    """Stand-in bytes of a page's size for checks that look at the size only (never read:
    zero pages the kernel maps on demand)."""
    got = _PLACEHOLDERS.get(nbytes)
    if got is None:
        got = _PLACEHOLDERS[nbytes] = bytes(nbytes)
    return got


class _Calls:
    """The live calls of one fetch attempt, so that a failing stream can cancel the others."""

    __slots__ = ("_calls", "_lock", "failed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Any] = []
        self.failed = False

    def add(self, call: Any) -> None:
        with self._lock:
            self._calls.append(call)
            if not self.failed:
                return
        call.cancel()

    def fail(self) -> None:
        with self._lock:
            self.failed = True
            calls = list(self._calls)
        for call in calls:
            call.cancel()


class SyncFetcher:
    """Blocking FetchPages over a pool of sync gRPC channels, one thread per stream.

    Why: the asyncio client does every stream's Python-side work (grpcio's
    copy of each message out of its buffers, the checks, the inserts) on its
    event loop's one thread, so its streams add no parallelism. Here each
    stream iterates its own call on its own thread and connection (grpcio's
    single-threaded unary-stream mode: no per-channel spin thread), checks
    each page and copies it into a reserved pool page itself; numpy copies,
    ``bytes.join`` and xxh3 release the GIL, so streams overlap. Only the
    commit (cache the page, under the pool lock) is serialized, in order.

    Pages are split over the streams interleaved (page i on stream i mod k)
    and handed over strictly in request order (`_Ordered`). Deadlines,
    retries (UNAVAILABLE only; a retry asks only for pages not yet received)
    and error translation are the same as `PeerClient.fetch_pages`. When a
    stream fails, the others are cancelled (the server unpins their pages),
    and every reservation not committed is released.
    """

    def __init__(
        self,
        address: str,
        config: TransferConfig,
        *,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.address = address
        self.config = config
        self._rng = rng if rng is not None else random.Random()
        self._sleep = sleep
        self._credentials = channel_credentials(config)
        self._options = _channel_options(config)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {config.auth_token}"),) if config.auth_token else ()
        )
        self._chunk_bytes = chunk_size(config)
        self._lock = threading.Lock()
        self._channels: list[grpc.Channel] = []
        self._closed = False
        self._tls = tls_context(config) if config.grpc_zero_copy else None
        tune_malloc(config)

    def zero_copy(self, service: PageService | PageReceiver | None, pages: int) -> bool:
        """Whether a fetch of `pages` pages into `service` takes the zero-copy path
        (`WireCall`). A CPU store's pages are read into from the socket; a device store's land
        in host memory first and are copied in once checked (still two copies fewer than
        grpcio's receive). Pulls under `grpc_zero_copy_min_bytes` stay on grpcio's reused
        connections: a `WireCall` opens its own (~2 ms per call on loopback, measured)."""
        return (
            self.config.grpc_zero_copy
            and service is not None
            and pages * service.store.page_nbytes >= self.config.grpc_zero_copy_min_bytes
        )

    def _stub(self, i: int) -> Any:
        with self._lock:
            if self._closed:
                raise TransportError(f"the client for peer {self.address} is closed")
            while len(self._channels) <= i:
                options = [*self._options, (SINGLE_THREADED_UNARY_STREAM, 1)]
                if self._credentials is not None:
                    ch = grpc.secure_channel(self.address, self._credentials, options)
                else:
                    ch = grpc.insecure_channel(self.address, options)
                self._channels.append(ch)
            channel = self._channels[i]
        return channel.unary_stream(
            _METHOD + "FetchPages",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=None,  # raw bytes: decode_chunk's errors stay kvmesh errors
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = self._channels, []
        for ch in channels:
            ch.close()

    def _remaining(self, end: float) -> float:
        left = end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(
                f"FetchPages to peer {self.address} ran out of its deadline; "
                f"{_HINTS[DeadlineExceeded]}"
            )
        return left

    def fetch(
        self,
        hashes: Sequence[PageHash],
        deliver: Callable[[int, _Item], None],
        *,
        service: PageReceiver | None = None,
        deadline_s: float | None = None,
        streams: int | None = None,
        with_checksum: bool = True,
    ) -> FetchResult:
        """Fetch `hashes`, handing each verified page to `deliver` in request order.

        With `service` (a CPU store), pages land in reserved pool pages and
        reach `deliver` as `_Landed` (checked: format, checksum, chain); the
        rest as `IncomingPage`s (checked as `with_checksum` says). On failure
        the error is raised; pages delivered before it are complete and valid,
        none after the first gap is, and no reservation is left behind.
        """
        timeout = self.config.deadline_s if deadline_s is None else deadline_s
        if timeout <= 0:
            raise InvalidInput(f"deadline must be positive, got {timeout}")
        end = time.monotonic() + timeout
        wanted = [check_hash(h) for h in hashes]
        order = _Ordered(deliver, service)
        k = max(1, min(streams or self.config.fetch_streams, len(wanted) or 1))
        todo = list(range(len(wanted)))
        tries = 0
        try:
            while todo:
                shards = [shard for shard in (todo[s::k] for s in range(k)) if shard]
                err = self._attempt(shards, wanted, order, end, service, with_checksum)
                if err is None:
                    break
                if not isinstance(err, grpc.RpcError):
                    raise err
                if err.code() != grpc.StatusCode.UNAVAILABLE or tries >= self.config.retries:
                    raise translate(err, "FetchPages", self.address) from None
                backoff = self.config.retry_backoff_s * (2**tries) * (0.5 + self._rng.random())
                tries += 1
                self._sleep(min(backoff, max(0.0, self._remaining(end) - 0.001)))
                todo = order.todo(len(wanted))
        finally:
            order.close()
        return FetchResult((), _in_request_order(order.missing), order.pages)

    def _attempt(
        self,
        shards: list[list[int]],
        hashes: list[PageHash],
        order: _Ordered,
        end: float,
        service: PageReceiver | None,
        with_checksum: bool,
    ) -> BaseException | None:
        """Run one stream per shard (the first on this thread); the first real error, if any."""
        calls = _Calls()
        errors: list[BaseException] = []
        lock = threading.Lock()

        def run(stream: int, shard: list[int]) -> None:
            try:
                self._stream(stream, shard, hashes, order, end, calls, service, with_checksum)
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                calls.fail()

        threads = [
            threading.Thread(target=run, args=(i, shard), name=f"kvmesh-fetch-{i}", daemon=True)
            for i, shard in enumerate(shards[1:], start=1)
        ]
        for t in threads:
            t.start()
        run(0, shards[0])
        for t in threads:
            # Every call carries the deadline, so the threads end by then; the
            # margin covers the cancellation itself.
            t.join(max(0.0, end - time.monotonic()) + 5.0)
        with lock:
            if not errors:
                return None
            real = [e for e in errors if not _cancelled_by_us(e)]
            return (real or errors)[0]

    def _stream(
        self,
        stream: int,
        indices: list[int],
        hashes: list[PageHash],
        order: _Ordered,
        end: float,
        calls: _Calls,
        service: PageReceiver | None,
        with_checksum: bool,
    ) -> None:
        request = pb.FetchRequest(
            page_hashes=[hashes[i] for i in indices], max_chunk_bytes=self._chunk_bytes
        )
        if service is not None and self.zero_copy(service, len(hashes)):
            self._wire_stream(request, indices, hashes, order, end, calls, service)
            return
        responses = self._stub(stream)(
            request, timeout=self._remaining(end), metadata=self._metadata
        )
        calls.add(responses)
        assembler = PageAssembler(
            service.store.page_nbytes if service is not None else None, allow_missing=True
        )
        try:

            def check(page: IncomingPage, expected: PageHash) -> _Item:
                return self._checked(page, expected, service, with_checksum)

            for raw in responses:
                take_fetched(assembler, raw, indices, hashes, self.address, order, check)
            end_fetch_stream(assembler, len(indices), self.address)
        finally:
            responses.cancel()  # a no-op once the call is over

    def _wire_stream(
        self,
        request: pb.FetchRequest,
        indices: list[int],
        hashes: list[PageHash],
        order: _Ordered,
        end: float,
        calls: _Calls,
        service: PageReceiver,
    ) -> None:
        """One stream read by `WireCall`, its pages landed by a `_Lander`."""
        with self._lock:
            if self._closed:
                raise TransportError(f"the client for peer {self.address} is closed")
        call = WireCall(self.address, self.config, self._tls, self.config.max_message_bytes)
        calls.add(call)
        lander = _Lander(service, indices, hashes, order, self.address)
        try:
            call.run(request, self._remaining(end), lander)
            lander.finish()
        finally:
            lander.abort()

    def _checked(
        self,
        page: IncomingPage,
        expected: PageHash,
        service: PageReceiver | None,
        with_checksum: bool,
    ) -> _Item:
        """Verify a received page; with `service`, check it for that pool and land it.

        Landing = reserve a pool page and copy the bytes into its KV tensor
        slot: the one copy a page costs on this side, done here, in parallel
        with the other streams (numpy copies without the GIL). The checks come
        first, so a refused page reserves, evicts and writes nothing. A page
        the pool cannot reserve (cached, being received elsewhere, no room)
        goes to `PageService.insert_many` in order instead.
        """
        if service is None:
            verify_page(page, expected, self.address, with_checksum=with_checksum)
            return page
        verify_page(page, expected, self.address, with_checksum=False)
        try:
            service.check(page)  # format, checksum and hash chain
        except ChecksumMismatch as exc:
            raise ChecksumMismatch(f"page from peer {self.address}: {exc}") from None
        store = service.store
        if store.device.type != "cpu":
            return page
        res = service.reserve([page.page_hash])[0]
        if res is None:
            return page
        try:
            store.import_page(res.page_id, page.blob, verified=True)
        except BaseException:
            service.release([res])
            raise
        return _Landed(res, page)


def _cancelled_by_us(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.CANCELLED


class SyncPeerClient:
    """Blocking wrapper: a `PeerClient` on a private event loop in a daemon thread.

    For sync callers (Ray actor methods, benchmarks, tests). Thread-safe:
    calls from several threads are serialized onto that loop. With
    `TransferConfig.grpc_sync_fetch`, fetches (`fetch_pages`, `pull_into`) go
    over a `SyncFetcher` instead, off the loop. `rng` and `sleep` are
    injectable for deterministic retry tests of those fetches.
    """

    def __init__(
        self,
        address: str,
        config: TransferConfig | None = None,
        *,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config if config is not None else TransferConfig()
        self._fetcher = (
            SyncFetcher(address, self.config, rng=rng, sleep=sleep)
            if self.config.grpc_sync_fetch or self.config.grpc_zero_copy
            else None
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvmesh-peer-client", daemon=True
        )
        self._thread.start()
        self._client = self._run(self._make(address), 10.0)

    async def _make(self, address: str) -> PeerClient:
        return PeerClient(address, self.config)

    @property
    def address(self) -> str:
        return self._client.address

    def _run(self, coro: Coroutine[Any, Any, T], deadline_s: float | None) -> T:
        timeout = (self.config.deadline_s if deadline_s is None else deadline_s) + 5.0
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise DeadlineExceeded(
                f"a call on the client loop did not return within {timeout:.1f}s; "
                "the loop thread is blocked"
            ) from None

    def lookup(self, hashes: Sequence[PageHash], *, deadline_s: float | None = None) -> list[bool]:
        return self._run(self._client.lookup(hashes, deadline_s=deadline_s), deadline_s)

    def health(self, *, deadline_s: float | None = None) -> str:
        return self._run(self._client.health(deadline_s=deadline_s), deadline_s)

    def fetch_pages(
        self,
        hashes: Sequence[PageHash],
        *,
        deadline_s: float | None = None,
        on_page: OnPage | None = None,
        streams: int | None = None,
    ) -> FetchResult:
        """See `PeerClient.fetch_pages`. `on_page` is called one page at a time in
        request order, on one of the fetch's threads (on the client's loop thread
        when `grpc_sync_fetch` is off)."""
        if self._fetcher is None or not self.config.grpc_sync_fetch:
            coro = self._client.fetch_pages(
                hashes, deadline_s=deadline_s, on_page=on_page, streams=streams
            )
            return self._run(coro, deadline_s)
        kept: list[IncomingPage] = []
        sink: OnPage = on_page if on_page is not None else (lambda _i, p: kept.append(p))

        def deliver(index: int, item: _Item) -> None:
            if isinstance(item, _Landed):  # pragma: no cover - only with a service
                raise InvariantViolation(f"page {index} landed in a pool no one asked for")
            sink(index, item)

        result = self._fetcher.fetch(hashes, deliver, deadline_s=deadline_s, streams=streams)
        return FetchResult(tuple(kept), result.missing, result.received)

    def pulls_in_place(self, service: PageService | PageReceiver, pages: int) -> bool:
        """Whether `pull_into` of `pages` pages into `service` receives straight into its
        pool (zero-copy; `SyncFetcher.zero_copy`)."""
        return self._fetcher is not None and self._fetcher.zero_copy(service, pages)

    def push_pages(
        self, pages: Sequence[IncomingPage], ticket: bytes, *, deadline_s: float | None = None
    ) -> list[bool]:
        return self._run(self._client.push_pages(pages, ticket, deadline_s=deadline_s), deadline_s)

    def push_from(
        self,
        service: PageService,
        hashes: Sequence[PageHash],
        ticket: bytes,
        *,
        deadline_s: float | None = None,
    ) -> list[bool]:
        return self._run(
            self._client.push_from(service, hashes, ticket, deadline_s=deadline_s), deadline_s
        )

    def pull_into(
        self, service: PageReceiver, hashes: Sequence[PageHash], *, deadline_s: float | None = None
    ) -> int:
        """See `PeerClient.pull_into`. Over `SyncFetcher` each page lands once, straight
        in a reserved page of `service`'s KV store, is checked there by the stream
        that received it, and is committed in request order."""
        fetcher = self._fetcher
        if fetcher is None or not (
            self.config.grpc_sync_fetch or fetcher.zero_copy(service, len(hashes))
        ):
            return self._run(
                self._client.pull_into(service, hashes, deadline_s=deadline_s), deadline_s
            )
        inserted = 0

        def deliver(_index: int, item: _Item) -> None:
            nonlocal inserted
            if isinstance(item, _Landed):
                inserted += service.commit([(item.reservation, item.page)])[0]
                return
            try:
                inserted += service.insert_many([item])[0]
            except ChecksumMismatch as exc:
                raise ChecksumMismatch(f"page from peer {self.address}: {exc}") from None

        fetcher.fetch(hashes, deliver, service=service, deadline_s=deadline_s, with_checksum=False)
        return inserted

    def close(self) -> None:
        """Close the connections and stop the loop thread (idempotent)."""
        if self._fetcher is not None:
            self._fetcher.close()
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> SyncPeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
