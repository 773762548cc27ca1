"""The worker's gRPC transfer server (`kvmesh.v1.KVWorker`): a `PageService` over gRPC.

- ``Lookup``: which hashes are held, in order;
- ``FetchPages``: streams pages (`kvmesh.worker.page_codec`), pinned a window
  at a time within the bounds of `kvmesh.worker.fetch_limits` (pin caps per
  peer and in all, a server-side deadline, an idle timeout); every pin is
  released on every path; a hash not held is one ``missing`` chunk, not an
  error; pages larger than the chunk size travel as several chunks;
- ``PushPages``: only with a live push grant of this worker (the ticket in
  ``kvmesh-push-ticket`` metadata, else ``PERMISSION_DENIED`` before a byte
  is read); reassembles chunks, proves each page against the grant's request
  and checks it (`PageService.check`) and caches it, within the pusher's
  eviction budget; pages completed before an error stay, the rest are dropped;
- the standard ``grpc.health.v1.Health`` service, SERVING / NOT_SERVING by
  `set_serving` (draining);
- optional TLS, mutual TLS (`TransferConfig.tls_*`) and a bearer token
  (`kvmesh.grpc_security`; missing / wrong: ``UNAUTHENTICATED``).

A `KVMeshError` travels as its ``grpc_code`` with the class name in the
``kvmesh-error`` trailing metadata, so the client raises the same class.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.config import TransferConfig
from kvmesh.errors import (
    DeadlineExceeded,
    InvalidInput,
    KVMeshError,
    PinLimitExceeded,
    TransportError,
)
from kvmesh.grpc_security import (  # shared with the coordinator's routing API
    ERROR_METADATA_KEY,
    TokenAuthInterceptor,
    server_credentials,
)
from kvmesh.metrics import TRANSFER_REFUSED
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.types import PageHash, PageId
from kvmesh.worker.fetch_limits import FetchPins, FetchStream, StreamWatch, WriteFailed, peer_key
from kvmesh.worker.grpc_tuning import grpc_tuning_options, server_options, tune_malloc
from kvmesh.worker.page_codec import (
    MIN_CHUNK_BYTES,
    PUSH_TICKET_KEY,
    SERVICE_NAME,
    PageAssembler,
    chunk_size,
    decode_chunk,
    encode_chunk,
    iter_page_chunks,
    page_header,
)
from kvmesh.worker.page_service import IncomingPage, PageService, check_hash

log = logging.getLogger(__name__)

PUSH_DRAIN_MESSAGES = 64  # messages a refused push may still have in flight, read and dropped
MAX_HASHES_PER_CALL = 100_000


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
        self._pins = FetchPins(service, self.config)
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
        server = grpc.aio.server(interceptors=interceptors, options=server_options(self.config))
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
        stream = FetchStream(self._pins, peer_key(context))
        watch = StreamWatch(self._pins.limits)
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
        except WriteFailed as exc:
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
        stream: FetchStream,
        watch: StreamWatch,
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

    def _cut_short(self, reason: str, stream: FetchStream, asked: int) -> str:
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
        watch: StreamWatch,
        stream: FetchStream,
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
