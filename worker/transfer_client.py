"""Client side of page transfer: `SyncPeerClient`, one peer's `kvmesh.v1.KVWorker`.

Every call has a deadline (`TransferConfig.deadline_s` unless given) and one
retry policy (`kvmesh.worker.call_retry.RetryPolicy`: ``UNAVAILABLE`` only,
idempotent calls only; a retried fetch asks again only for the pages it has
not received). Failures raise kvmesh errors that name the peer and what to
do: `DeadlineExceeded`, `Unauthenticated`, `ChecksumMismatch`,
`MessageTooLarge`, `TransportError` (and the server's own `KVMeshError`
class when it sent one).

One fetch engine (`PageFetcher`): the hashes are split over
`fetch_streams` concurrent FetchPages streams, interleaved (page i on stream
i mod k), each on its own thread and its own pooled connection
(`kvmesh.worker.grpc_wire`: reused from pull to pull, each page's bytes read
from the socket straight to where they stay, `kvmesh.worker.page_landing`),
and the pages reach the caller strictly in request order, each checked
(framing, dtype, shape, size, checksum, the page asked for, and with a pool
its proof) before it is handed over. If the peer dies mid-stream, the pages
handed over so far are complete and valid, and none after the first gap is.
Lookup, Health and PushPages go over one grpcio channel.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.config import TransferConfig
from kvmesh.errors import ChecksumMismatch, InvariantViolation, TransportError, UnknownHash
from kvmesh.grpc_security import channel_credentials
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.types import PageHash
from kvmesh.worker.call_retry import RetryPolicy
from kvmesh.worker.grpc_tuning import channel_options, tune_malloc
from kvmesh.worker.page_codec import PUSH_TICKET_KEY, SERVICE_NAME, chunk_size, iter_page_chunks
from kvmesh.worker.page_landing import InOrder, Item, Landed, PageLander
from kvmesh.worker.page_service import IncomingPage, PageReceiver, PageService, check_hash
from kvmesh.worker.wire_pool import ChannelPool, FetchCall

_METHOD = f"/{SERVICE_NAME}/"
OnPage = Callable[[int, IncomingPage], None]
"""Called with (request index, page) for every received page, in request order."""


@dataclass(frozen=True, slots=True)
class FetchResult:
    """What a fetch returned: the pages (in request order) and the hashes the peer lacks.

    `pages` is empty when the pages went to an ``on_page`` callback instead.
    """

    pages: tuple[IncomingPage, ...]
    missing: tuple[PageHash, ...]  # in request order
    received: int


class _Calls:
    """The live calls of one fetch attempt, so that a failing stream can cancel the others."""

    __slots__ = ("_calls", "_lock", "failed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[FetchCall] = []
        self.failed = False

    def add(self, call: FetchCall) -> None:
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


def _cancelled_by_us(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.CANCELLED


class PageFetcher:
    """FetchPages from one peer: concurrent streams over reused connections, pages in order.

    Why threads: each stream's socket reads, checksums and copies release the
    GIL, so streams overlap; only the commit (cache the page, under the pool
    lock) is serialized, in request order (`InOrder`). When a stream fails,
    the others are cancelled (the server unpins their pages), and every
    reservation not committed is released.
    """

    def __init__(self, address: str, config: TransferConfig, retry: RetryPolicy) -> None:
        self.address = address
        self.config = config
        self._retry = retry
        self._chunk_bytes = chunk_size(config)
        self._pool = ChannelPool(address, config)

    def close(self) -> None:
        self._pool.close()

    def fetch(
        self,
        hashes: Sequence[PageHash],
        deliver: Callable[[int, Item], None],
        *,
        service: PageReceiver | None = None,
        deadline_s: float | None = None,
        streams: int | None = None,
    ) -> FetchResult:
        """Fetch `hashes`, handing each checked page to `deliver` in request order.

        With `service`, pages land in reserved pool pages and reach `deliver` as
        `Landed` (checked: format, checksum, proof); a page the pool cannot
        reserve, and every page without `service`, as an `IncomingPage` (checked:
        format, checksum). On failure the error is raised; pages delivered before
        it are complete and valid, none after the first gap is, and no
        reservation is left behind.
        """
        end = self._retry.deadline(self.config.deadline_s if deadline_s is None else deadline_s)
        wanted = [check_hash(h) for h in hashes]
        order = InOrder(deliver, service)
        k = max(1, min(streams or self.config.fetch_streams, len(wanted) or 1))

        def attempt(_timeout: float) -> None:
            todo = order.todo(len(wanted))  # a retry asks only for what has not arrived
            shards = [shard for shard in (todo[s::k] for s in range(k)) if shard]
            if shards:
                self._attempt(shards, wanted, order, end, service)

        try:
            self._retry.run("FetchPages", attempt, end, idempotent=True)
        finally:
            order.close()
        return FetchResult((), order.missing_in_order(), order.pages)

    def _attempt(
        self,
        shards: list[list[int]],
        hashes: list[PageHash],
        order: InOrder,
        end: float,
        service: PageReceiver | None,
    ) -> None:
        """Run one stream per shard (the first on this thread); raise the first real error."""
        calls = _Calls()
        errors: list[BaseException] = []
        lock = threading.Lock()

        def run(shard: list[int]) -> None:
            try:
                self._stream(shard, hashes, order, end, calls, service)
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                calls.fail()

        threads = [
            threading.Thread(target=run, args=(shard,), name=f"kvmesh-fetch-{i}", daemon=True)
            for i, shard in enumerate(shards[1:], start=1)
        ]
        for t in threads:
            t.start()
        run(shards[0])
        for t in threads:
            # Every call carries the deadline, so the threads end by then; the
            # margin covers the cancellation itself.
            t.join(max(0.0, end - time.monotonic()) + 5.0)
        with lock:
            if errors:
                real = [e for e in errors if not _cancelled_by_us(e)]
                raise (real or errors)[0]

    def _stream(
        self,
        indices: list[int],
        hashes: list[PageHash],
        order: InOrder,
        end: float,
        calls: _Calls,
        service: PageReceiver | None,
    ) -> None:
        request = pb.FetchRequest(
            page_hashes=[hashes[i] for i in indices], max_chunk_bytes=self._chunk_bytes
        )
        call = FetchCall(self._pool)
        calls.add(call)
        lander = PageLander(service, indices, hashes, order, self.address)
        try:
            call.run(request, end, lander)
            lander.finish()
        finally:
            lander.abort()


class SyncPeerClient:
    """Client for one peer's `kvmesh.v1.KVWorker`; blocking, thread-safe, connections reused.

    `rng` and `sleep` are injectable for deterministic retry tests.
    """

    def __init__(
        self,
        address: str,
        config: TransferConfig | None = None,
        *,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.address = address
        self.config = config if config is not None else TransferConfig()
        self._retry = RetryPolicy.of(address, self.config, rng, sleep)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {self.config.auth_token}"),)
            if self.config.auth_token
            else ()
        )
        self._chunk_bytes = chunk_size(self.config)
        credentials = channel_credentials(self.config)
        options = channel_options(self.config)
        self._fetcher = PageFetcher(address, self.config, self._retry)
        self._channel = (
            grpc.secure_channel(address, credentials, options)
            if credentials is not None
            else grpc.insecure_channel(address, options)
        )
        self._lookup = self._channel.unary_unary(
            _METHOD + "Lookup",
            request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupResponse.FromString,
        )
        self._push = self._channel.stream_unary(
            _METHOD + "PushPages",
            request_serializer=None,
            response_deserializer=pb.PushResponse.FromString,
        )
        self._health = health_pb2_grpc.HealthStub(self._channel)
        tune_malloc(self.config)

    def _end(self, deadline_s: float | None) -> float:
        return self._retry.deadline(self.config.deadline_s if deadline_s is None else deadline_s)

    def lookup(self, hashes: Sequence[PageHash], *, deadline_s: float | None = None) -> list[bool]:
        """For each hash, whether the peer holds it (in order)."""
        request = pb.LookupRequest(page_hashes=list(hashes))

        def attempt(timeout: float) -> list[bool]:
            return list(self._lookup(request, timeout=timeout, metadata=self._metadata).held)

        held = self._retry.run("Lookup", attempt, self._end(deadline_s), idempotent=True)
        if len(held) != len(hashes):
            raise TransportError(
                f"peer {self.address} answered {len(held)} lookups for {len(hashes)} hashes"
            )
        return held

    def health(self, *, deadline_s: float | None = None, service: str = SERVICE_NAME) -> str:
        """The peer's standard health status: ``SERVING``, ``NOT_SERVING``, ..."""
        request = health_pb2.HealthCheckRequest(service=service)

        def attempt(timeout: float) -> str:
            reply = self._health.Check(request, timeout=timeout, metadata=self._metadata)
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

        return self._retry.run("Health", attempt, self._end(deadline_s), idempotent=True)

    def fetch_pages(
        self,
        hashes: Sequence[PageHash],
        *,
        deadline_s: float | None = None,
        on_page: OnPage | None = None,
        streams: int | None = None,
    ) -> FetchResult:
        """Fetch the pages for `hashes`; each is checked (format, checksum) before it is
        handed over. With `on_page`, pages go to it in request order as they arrive (one
        at a time, on one of the fetch's threads) and are not kept; otherwise they are
        returned. On failure this raises; pages already handed to `on_page` are valid and
        complete, later ones are not handed over."""
        kept: list[IncomingPage] = []
        sink: OnPage = on_page if on_page is not None else (lambda _i, p: kept.append(p))

        def deliver(index: int, item: Item) -> None:
            if isinstance(item, Landed):  # pragma: no cover - only with a service
                raise InvariantViolation(f"page {index} landed in a pool no one asked for")
            sink(index, item)

        result = self._fetcher.fetch(hashes, deliver, deadline_s=deadline_s, streams=streams)
        return FetchResult(tuple(kept), result.missing, result.received)

    def pull_into(
        self, service: PageReceiver, hashes: Sequence[PageHash], *, deadline_s: float | None = None
    ) -> int:
        """Fetch `hashes` into `service`'s pool; returns the pages inserted.

        Each page lands once, straight in a reserved page of `service`'s KV
        store, is checked there (format, checksum, proof) by the stream that
        received it, and is committed in request order. Pages the local pool
        already holds are skipped (not counted). On failure (peer died,
        deadline, bad page) the error is raised; the pages inserted before it
        are complete and valid, no later page is inserted.
        """
        inserted = 0

        def deliver(_index: int, item: Item) -> None:
            nonlocal inserted
            if isinstance(item, Landed):
                inserted += service.commit([(item.reservation, item.page)])[0]
                return
            try:
                inserted += service.insert_many([item])[0]
            except ChecksumMismatch as exc:
                raise ChecksumMismatch(f"page from peer {self.address}: {exc}") from None

        self._fetcher.fetch(hashes, deliver, service=service, deadline_s=deadline_s)
        return inserted

    def push_pages(
        self, pages: Sequence[IncomingPage], ticket: bytes, *, deadline_s: float | None = None
    ) -> list[bool]:
        """Push pages for the peer to check and cache; per page: True new, False already held.

        `ticket` is the grant the peer handed out for this request's pages
        (`PageService.grants.grant` there); without a live one the peer refuses
        the push (`PermissionDenied`). Never retried (not idempotent from the
        caller's view: a retry after a partial success would be
        indistinguishable). On failure the pages the peer finished before the
        error stay cached there, the rest do not.
        """
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

        def attempt(timeout: float) -> list[bool]:
            return list(self._push(messages(), timeout=timeout, metadata=metadata).inserted)

        return self._retry.run("PushPages", attempt, self._end(deadline_s), idempotent=False)

    def push_from(
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
            return self.push_pages(pages, ticket, deadline_s=deadline_s)
        finally:
            service.unpin(ids)

    def close(self) -> None:
        """Close the connections (idempotent)."""
        self._fetcher.close()
        self._channel.close()

    def __enter__(self) -> SyncPeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
