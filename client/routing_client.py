"""A small client of the coordinator's gRPC routing API, for callers outside Ray.

`RoutingClient` talks to one or more routers (`host:port` each: the
coordinator actor or its replicas, `CoordinatorConfig.api_port`) with the
cluster's TLS / mutual TLS and bearer token (`TransferConfig`, as the page
service). Every call has a deadline. When a router does not answer
(``UNAVAILABLE``, ``DEADLINE_EXCEEDED``) the same call goes to the next one,
so a replica's death costs a retry, not a request: Route, Register, Stats
and Health are idempotent, and a Report sent twice is ignored by its seq.
Any other error is the server's answer and is raised as the same kvmesh
class (`kvmesh.grpc_security.error_from_rpc`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from kvmesh.config import TransferConfig
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.errors import ConfigError, KVMeshError, TransportError
from kvmesh.grpc_security import channel_credentials, error_from_rpc
from kvmesh.logs import request_scope
from kvmesh.proto import kvmesh_pb2 as pb

T = TypeVar("T")
_FAIL_OVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_SERVICE = "/kvmesh.v1.Coordinator/"


@dataclass(frozen=True, slots=True)
class RoutedTo:
    """A routing decision as the API returns it: the worker, its address and the peer's."""

    worker_id: str
    worker_address: str
    matched_pages: int
    peer_worker_id: str | None
    peer_address: str | None
    peer_pages: int
    total_pages: int
    policy: str
    degraded: bool
    router: str  # the router that answered
    promote_pages: int = 0  # of matched_pages, in the worker's host or disk tier
    cost: float = 0.0  # the policy's cost of the chosen worker
    request_id: str = ""  # the query's, echoed
    decode: RoutedTo | None = None  # a split query's decode worker


def _routed_to(r: pb.RouteResponse, router: str) -> RoutedTo:
    return RoutedTo(
        r.worker_id,
        r.worker_address,
        r.matched_pages,
        r.peer_worker_id or None,
        r.peer_address or None,
        r.peer_pages,
        r.total_pages,
        r.policy,
        r.degraded,
        router,
        r.promote_pages,
        r.cost,
        r.request_id,
        _routed_to(r.decode, router) if r.HasField("decode") else None,
    )


class RoutingClient:
    """Route, register, report and read stats through the gRPC routing API (thread-safe)."""

    def __init__(
        self,
        addresses: Sequence[str] | str,
        security: TransferConfig | None = None,
        *,
        deadline_s: float | None = None,
    ) -> None:
        addrs = [addresses] if isinstance(addresses, str) else list(addresses)
        if not addrs or not all(isinstance(a, str) and a for a in addrs):
            raise ConfigError(f"RoutingClient needs at least one host:port, got {addresses!r}")
        self.security = security or TransferConfig()
        self.deadline_s = self.security.deadline_s if deadline_s is None else deadline_s
        if self.deadline_s <= 0:
            raise ConfigError(f"deadline_s must be positive, got {self.deadline_s}")
        self.addresses = addrs
        creds = channel_credentials(self.security)
        options: list[tuple[str, int | str]] = [("grpc.enable_retries", 0)]
        if self.security.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.security.tls_server_name))
        self._channels = [
            grpc.insecure_channel(a, options=options)
            if creds is None
            else grpc.secure_channel(a, creds, options=options)
            for a in addrs
        ]
        token = self.security.auth_token
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._lock = threading.Lock()
        self._current = 0

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> RoutingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Message, reply: type[T]) -> tuple[T, str]:
        """One call, failing over across the routers in turn; returns (reply, router)."""
        with self._lock:
            first = self._current
        last: KVMeshError | None = None
        for k in range(len(self._channels)):
            i = (first + k) % len(self._channels)
            stub: Callable[..., Any] = self._channels[i].unary_unary(
                _SERVICE + method,
                request_serializer=type(request).SerializeToString,
                response_deserializer=reply.FromString,  # type: ignore[attr-defined]
            )
            try:
                out = stub(request, timeout=self.deadline_s, metadata=self._metadata)
            except grpc.RpcError as err:
                last = error_from_rpc(err, method, self.addresses[i])
                if err.code() in _FAIL_OVER:
                    continue
                raise last from None
            with self._lock:
                self._current = i
            return out, self.addresses[i]
        raise last or TransportError("no router to call")

    def route(self, query: RouteQuery) -> RoutedTo:
        """Where `query`'s request goes (the same decision as the Ray API's route)."""
        req = pb.RouteRequest(
            page_hashes=list(query.hashes),
            num_tokens=query.num_tokens,
            page_size=query.page_size,
            allow_pull=query.allow_pull,
            role=query.role or "",
            policy=query.policy or "",
            request_id=query.request_id,
            tenant=query.tenant or "",
            split=query.split,
            after=[
                pb.ReportMark(worker_id=m.worker_id, incarnation=m.incarnation, seq=m.seq)
                for m in query.after
            ],
        )
        with request_scope(query.request_id):  # the request's id on the error we raise
            r, router = self._call("Route", req, pb.RouteResponse)
        return _routed_to(r, router)

    def register(self, reg: WorkerRegistration) -> bool:
        """Register a worker or engine; True when the coordinator wants a snapshot batch first.
        (An engine has no Ray actor: the actor fields do not travel.)"""
        req = pb.RegisterRequest(
            worker_id=reg.worker_id,
            address=reg.address,
            capacity=reg.capacity,
            incarnation=reg.incarnation,
            role=reg.role,
        )
        reply, _ = self._call("Register", req, pb.RegisterResponse)
        return bool(reply.needs_snapshot)

    def report(self, report: WorkerReport) -> tuple[bool, list[str]]:
        """Send encoded event batches (the load, the requests' outcomes); returns (resync
        wanted, result per batch)."""
        req = pb.ReportRequest(
            worker_id=report.worker_id,
            batches=list(report.batches),
            outcomes=[
                pb.RouteOutcomeReport(
                    promised_local=o.promised_local,
                    promised_pull=o.promised_pull,
                    realized_local=o.realized_local,
                    realized_pull=o.realized_pull,
                )
                for o in report.outcomes
            ],
        )
        load = report.load
        if load is not None:
            req.load.CopyFrom(
                pb.WorkerLoadReport(
                    active_prefill_tokens=load.active_prefill_tokens,
                    active_decode_pages=load.active_decode_pages,
                    free_pages=load.free_pages,
                    total_pages=load.total_pages,
                    active_requests=load.active_requests,
                )
            )
        reply, _ = self._call("Report", req, pb.ReportResponse)
        return bool(reply.resync), list(reply.results)

    def stats(self) -> dict[str, float]:
        reply, _ = self._call("Stats", pb.StatsRequest(), pb.StatsResponse)
        return dict(reply.values)

    def health(self) -> pb.HealthResponse:
        reply, _ = self._call("Health", pb.HealthRequest(), pb.HealthResponse)
        return reply
