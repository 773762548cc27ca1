"""The Ray actor handles components hold of each other, typed by what they call on them.

A client holds the coordinator's and the workers' handles, a worker the
coordinator's, a router replica its shards' and peers'. Neither may import the
other's actor class (tests/test_layering.py), and Ray's own `ActorHandle` types
every method as `Never`, which makes mypy skip the code after the first call
silently. So each handle is a `Protocol` here naming the remote methods called
across the boundary, with their arguments and results in base types; a real
`ActorHandle` fits any of them, and tests/kvmesh/test_handles.py checks that the
actor classes really have these methods, parameters and results. `handle_of`
turns what creating an actor returned into the handle it is.

`RegisteredWorker` is what the coordinator's `workers()` answers, as far as a
caller needs it to find each worker's actor; `ReportReply` what a report's
answer tells a worker. A worker reports to a `WorkerCoordinator`: the actor's
handle, or a coordinator in its own process (tests, tools), called by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeAlias, TypeVar, cast

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
    from kvmesh.rendezvous import DistRendezvous
    from kvmesh.requests import (
        GenerateRequest,
        GenerationResult,
        PrefillResult,
        ReportMark,
        Role,
        RouteDecision,
        WorkerStats,
    )
    from kvmesh.types import WorkerId

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A")


class RemoteMethod(Protocol[P, R]):
    """One actor method seen through a handle: `.remote(...)` starts it, the ref is awaited."""

    def remote(self, *args: P.args, **kwargs: P.kwargs) -> ObjectRef[R]: ...


class ActorRef(Protocol):
    """Any actor handle: Ray's id tells whether two handles reach one actor."""

    @property
    def _actor_id(self) -> object: ...


class RegisteredWorker(Protocol):
    """A worker as the coordinator lists it: where it serves and which Ray actor it is."""

    @property
    def worker_id(self) -> WorkerId: ...
    @property
    def role(self) -> Role: ...
    @property
    def address(self) -> str: ...
    @property
    def actor_name(self) -> str | None: ...
    @property
    def actor_namespace(self) -> str | None: ...


class ReportReply(Protocol):
    """The coordinator's answer to a worker's report, as far as the worker reads it."""

    @property
    def needs_snapshot(self) -> bool: ...


class InProcessCoordinator(Protocol):
    """A coordinator a worker calls directly, in one process (tests, tools): what it calls."""

    def register_worker(self, reg: WorkerRegistration) -> object: ...
    def report(self, report: WorkerReport) -> ReportReply: ...


class WorkerActorHandle(ActorRef, Protocol):
    """A worker actor (`kvmesh.worker.actor.WorkerActor`), as clients and the coordinator call it."""

    @property
    def generate(self) -> RemoteMethod[[GenerateRequest], GenerationResult]: ...
    @property
    def expect_push(self) -> RemoteMethod[[GenerateRequest], bytes]: ...
    @property
    def prefill(self) -> RemoteMethod[[GenerateRequest, str, bytes], PrefillResult]: ...
    @property
    def stats(self) -> RemoteMethod[[], WorkerStats]: ...
    @property
    def reset_cache(self) -> RemoteMethod[[], None]: ...
    @property
    def shutdown(self) -> RemoteMethod[[], None]: ...
    @property
    def snapshot(self) -> RemoteMethod[[], bytes]: ...
    @property
    def dist_accept(self) -> RemoteMethod[[DistRendezvous], bool]: ...
    @property
    def info(self) -> RemoteMethod[[], dict[str, Any]]: ...


class CoordinatorHandle(ActorRef, Protocol):
    """The coordinator actor or a router replica (`kvmesh.coordinator.actor.CoordinatorActor`,
    `kvmesh.coordinator.router.RouterActor`), as clients, workers and replicas call it."""

    @property
    def wait_ready(self) -> RemoteMethod[[], bool]: ...
    @property
    def workers(self) -> RemoteMethod[[], Sequence[RegisteredWorker]]: ...
    @property
    def route(self) -> RemoteMethod[[RouteQuery], RouteDecision]: ...
    @property
    def stats(self) -> RemoteMethod[[Sequence[ReportMark]], dict[str, Any]]: ...
    @property
    def remove_worker(self) -> RemoteMethod[[WorkerId], bool]: ...
    @property
    def address_of(self) -> RemoteMethod[[WorkerId], str]: ...
    @property
    def api_address(self) -> RemoteMethod[[], str | None]: ...
    @property
    def dist_link(self) -> RemoteMethod[[WorkerId, str], DistRendezvous]: ...
    @property
    def register_worker(self) -> RemoteMethod[[WorkerRegistration], object]: ...
    @property
    def report(self) -> RemoteMethod[[WorkerReport], ReportReply]: ...
    @property
    def drain_worker(self) -> RemoteMethod[[WorkerId, bool], None]: ...


WorkerCoordinator: TypeAlias = CoordinatorHandle | InProcessCoordinator
"""What a worker reports to: the coordinator's actor, or one in the same process."""


def handle_of(created: ActorHandle[A] | type[A]) -> ActorHandle[A]:
    """What `ray.remote(Class).options(...).remote(...)` returned, as the handle it is.

    Ray types it as the handle or the class (for `@ray.method`-typed classes); at
    run time it is always the handle, which `ray.kill` and the protocols here take.
    """
    return cast("ActorHandle[A]", created)


__all__ = [
    "ActorRef",
    "CoordinatorHandle",
    "InProcessCoordinator",
    "RegisteredWorker",
    "RemoteMethod",
    "ReportReply",
    "WorkerActorHandle",
    "WorkerCoordinator",
    "handle_of",
]
