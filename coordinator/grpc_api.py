"""The coordinator's gRPC routing API: proto's ``kvmesh.v1.Coordinator`` service.

For routers, gateways and engines outside the Ray cluster (Ray pickles actor
arguments, so only trusted callers may use the actors directly). The server
adapts a `RoutingBackend`: the coordinator actor or a router replica serves
it from its own event loop (`CoordinatorConfig.api_port` >= 0), and tests
serve a plain `Coordinator` through `LocalBackend`.

Security and errors are the page service's (`kvmesh.grpc_security`): the
same TLS / mutual TLS credentials and bearer token (`TransferConfig`), the
standard health service exempt from the token; a `KVMeshError` travels as its
``grpc_code`` with its class name in ``kvmesh-error``. Every request is
parsed in the handler, so bytes that are not the message are
``INVALID_ARGUMENT``, and checked (hash sizes, counts, role, policy, ids)
before the backend sees it: a refused call changes nothing. Each call runs
within ``min(api_deadline_s, the caller's deadline)``; past it,
``DEADLINE_EXCEEDED``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.config import CoordinatorConfig, TransferConfig
from kvmesh.coordination import (
    MAX_ID_CHARS,
    ReportMark,
    RouteQuery,
    WorkerRegistration,
    WorkerReport,
)
from kvmesh.coordinator.policies import REGISTRY, RouteDecision, WorkerLoad
from kvmesh.coordinator.service import Registration, ReportResult
from kvmesh.errors import DeadlineExceeded, InvalidInput, KVMeshError
from kvmesh.grpc_security import ERROR_METADATA_KEY, TokenAuthInterceptor, server_credentials
from kvmesh.logs import request_scope
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.requests import ROLES, Role, RouteOutcome
from kvmesh.types import PageHash, WorkerId

if TYPE_CHECKING:
    from kvmesh.coordinator.service import Coordinator
    from kvmesh.coordinator.shards import ShardedCoordinator

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name  # "kvmesh.v1.Coordinator"
MAX_ROUTE_HASHES = 100_000
MAX_BATCHES_PER_REPORT = 1024
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
T = TypeVar("T")


class RoutingBackend(Protocol):
    """What the API needs from a coordinator (the actor's and the router's async methods)."""

    async def route(self, query: RouteQuery) -> RouteDecision: ...

    async def register_worker(self, reg: WorkerRegistration) -> Registration: ...

    async def report(self, report: WorkerReport) -> ReportResult: ...

    async def stats(self) -> dict[str, Any]: ...

    async def address_of(self, worker_id: WorkerId) -> str: ...

    async def health(self) -> dict[str, Any]: ...


class LocalBackend:
    """A `RoutingBackend` over an in-process coordinator (`Coordinator` or `ShardedCoordinator`)."""

    def __init__(self, core: Coordinator | ShardedCoordinator) -> None:
        self.core = core

    async def route(self, query: RouteQuery) -> RouteDecision:
        decision: RouteDecision = self.core.route(query)
        return decision

    async def register_worker(self, reg: WorkerRegistration) -> Registration:
        out: Registration = self.core.register_worker(reg)
        return out

    async def report(self, report: WorkerReport) -> ReportResult:
        result: ReportResult = self.core.report(report)
        return result

    async def stats(self) -> dict[str, Any]:
        stats = self.core.stats()
        return stats if isinstance(stats, dict) else dict(stats.as_dict())

    async def address_of(self, worker_id: WorkerId) -> str:
        for info in self.core.workers():
            if info.worker_id == worker_id:
                return str(info.address)
        return ""

    async def health(self) -> dict[str, Any]:
        shards = len(getattr(self.core, "shards", [None]))
        return {"serving": True, "workers": len(self.core.workers()), "shards": shards}


def _role(value: str, empty: Role | None) -> Role | None:
    if not value:
        return empty
    if value not in ROLES:
        raise InvalidInput(f"role must be one of {ROLES} or empty, got {value!r:.40}")
    role: Role = value
    return role


def _hashes(raw: Sequence[bytes]) -> list[PageHash]:
    if len(raw) > MAX_ROUTE_HASHES:
        raise InvalidInput(f"{len(raw)} page hashes in one call; at most {MAX_ROUTE_HASHES}")
    for h in raw:
        if not 0 < len(h) <= 64:
            raise InvalidInput(f"a page hash must be 1-64 bytes, got {len(h)}")
    return [PageHash(h) for h in raw]


def route_query(req: pb.RouteRequest) -> RouteQuery:
    """The `RouteQuery` a RouteRequest asks; `InvalidInput` for any field out of bounds."""
    if req.policy and req.policy not in REGISTRY:
        raise InvalidInput(f"unknown policy {req.policy!r:.40}; known: {sorted(REGISTRY)}")
    if len(req.after) > MAX_ROUTE_HASHES:
        raise InvalidInput(f"{len(req.after)} report marks in one call; at most {MAX_ROUTE_HASHES}")
    return RouteQuery(
        tuple(_hashes(req.page_hashes)),
        req.num_tokens,
        req.page_size or 16,
        req.allow_pull,
        _role(req.role, None),
        req.policy or None,
        req.request_id,
        req.tenant or None,
        tuple(ReportMark(WorkerId(m.worker_id), m.incarnation, m.seq) for m in req.after),
        req.split,
    )


def route_response(
    decision: RouteDecision, address: str, peer_address: str, request_id: str = ""
) -> pb.RouteResponse:
    return pb.RouteResponse(
        worker_id=decision.worker_id,
        worker_address=address,
        matched_pages=decision.local_pages,
        peer_worker_id=decision.peer_id or "",
        peer_address=peer_address,
        peer_pages=decision.peer_pages,
        policy=decision.policy,
        total_pages=decision.total_pages,
        degraded=decision.degraded,
        cost=decision.cost,
        promote_pages=decision.promote_pages,
        request_id=request_id,
    )


class CoordinatorAPIServer:
    """A `grpc.aio` server of the Coordinator service over `backend`, on the caller's event loop."""

    def __init__(
        self,
        backend: RoutingBackend,
        config: CoordinatorConfig,
        security: TransferConfig | None = None,
    ) -> None:
        self.backend = backend
        self.config = config
        self.security = security or TransferConfig()
        self._credentials = server_credentials(self.security)  # ConfigError before binding
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.api_host}:{self.port}"

    async def start(self) -> int:
        """Bind `api_host:api_port` (0: a free port) and serve; returns the port."""
        interceptors = (
            [TokenAuthInterceptor(self.security.auth_token)] if self.security.auth_token else []
        )
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        server.add_generic_rpc_handlers((self._handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        bind = f"{self.config.api_host}:{self.config.api_port if self.config.api_port > 0 else 0}"
        if self._credentials is None:
            port = server.add_insecure_port(bind)
        else:
            port = server.add_secure_port(bind, self._credentials)
        await server.start()
        self._server, self.port = server, port
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("coordinator routing API at %s", self.address)
        return port

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    def _handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[[Any], Awaitable[Message]], request: type[Message]) -> Any:
            async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
                try:
                    try:
                        msg = request.FromString(raw)
                    except DecodeError as exc:
                        raise InvalidInput(f"not a {request.__name__}: {exc}") from None
                    reply = await self._within_deadline(fn(msg), context)
                    return reply.SerializeToString()
                except KVMeshError as exc:
                    await context.abort(
                        grpc.StatusCode[exc.grpc_code],
                        f"{type(exc).__name__}: {exc}",
                        trailing_metadata=((ERROR_METADATA_KEY, type(exc).__name__),),
                    )
                    raise  # abort raises; this line is for the type checker

            return grpc.unary_unary_rpc_method_handler(handle)

        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Route": unary(self._route, pb.RouteRequest),
                "Register": unary(self._register, pb.RegisterRequest),
                "Report": unary(self._report, pb.ReportRequest),
                "Stats": unary(self._stats, pb.StatsRequest),
                "Health": unary(self._health_call, pb.HealthRequest),
            },
        )

    async def _within_deadline(self, call: Awaitable[T], context: grpc.aio.ServicerContext) -> T:
        limit = self.config.api_deadline_s
        left = context.time_remaining()
        if left is not None:
            limit = min(limit, max(left, 0.0))
        try:
            return await asyncio.wait_for(call, limit)
        except TimeoutError:
            raise DeadlineExceeded(
                f"the coordinator did not answer within {limit:.3g}s "
                "(CoordinatorConfig.api_deadline_s or the caller's deadline)"
            ) from None

    async def _route(self, req: pb.RouteRequest) -> pb.RouteResponse:
        query = route_query(req)
        with request_scope(query.request_id):  # its id on our logs and on the error we raise
            decision = await self.backend.route(query)
            reply = await self._response(decision, query.request_id)
            if decision.decode is not None:
                reply.decode.CopyFrom(await self._response(decision.decode, query.request_id))
        return reply

    async def _response(self, decision: RouteDecision, request_id: str) -> pb.RouteResponse:
        """`decision` with its worker's and peer's addresses."""
        address = await self.backend.address_of(decision.worker_id)
        peer = await self.backend.address_of(decision.peer_id) if decision.peer_id else ""
        return route_response(decision, address, peer, request_id)

    async def _register(self, req: pb.RegisterRequest) -> pb.RegisterResponse:
        reg = await self.backend.register_worker(
            WorkerRegistration(
                WorkerId(req.worker_id),
                req.address,
                req.capacity,
                req.incarnation,
                _role(req.role, "both") or "both",
            )
        )
        return pb.RegisterResponse(
            needs_snapshot=reg.needs_snapshot,
            heartbeat_interval_s=reg.heartbeat_interval_s,
            heartbeat_timeout_s=reg.heartbeat_timeout_s,
        )

    async def _report(self, req: pb.ReportRequest) -> pb.ReportResponse:
        if not 0 < len(req.worker_id) <= MAX_ID_CHARS:
            raise InvalidInput(
                f"worker_id must be 1-{MAX_ID_CHARS} characters, got {req.worker_id!r:.60}"
            )
        wid = WorkerId(req.worker_id)
        batches = ([req.batch] if req.batch else []) + list(req.batches)
        if len(batches) > MAX_BATCHES_PER_REPORT or len(req.outcomes) > MAX_BATCHES_PER_REPORT:
            raise InvalidInput(
                f"{len(batches)} batches and {len(req.outcomes)} outcomes in one report; "
                f"at most {MAX_BATCHES_PER_REPORT} of each"
            )
        load = None
        if req.HasField("load"):
            m = req.load
            load = WorkerLoad(
                wid,
                active_prefill_tokens=m.active_prefill_tokens,
                active_decode_pages=m.active_decode_pages,
                free_pages=m.free_pages,
                total_pages=m.total_pages,
                active_requests=m.active_requests,
            )
        outcomes = tuple(
            RouteOutcome(o.promised_local, o.promised_pull, o.realized_local, o.realized_pull)
            for o in req.outcomes
        )
        result = await self.backend.report(WorkerReport(wid, tuple(batches), load, outcomes))
        return pb.ReportResponse(
            resync=result.needs_snapshot, results=[r.value for r in result.results]
        )

    async def _stats(self, _req: pb.StatsRequest) -> pb.StatsResponse:
        stats = await self.backend.stats()
        values = {
            k: float(v)
            for k, v in stats.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        return pb.StatsResponse(values=values)

    async def _health_call(self, _req: pb.HealthRequest) -> pb.HealthResponse:
        h = await self.backend.health()
        return pb.HealthResponse(
            serving=bool(h.get("serving")),
            workers=int(h.get("workers", 0)),
            shards=int(h.get("shards", 1)),
            replicas=int(h.get("replicas", 1)),
        )
