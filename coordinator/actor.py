"""The coordinator as a named Ray actor: a thin async shell around `Coordinator`.

One actor per cluster namespace, named `CoordinatorConfig.actor_name`
(``kvmesh-coordinator``) in `CoordinatorConfig.namespace`, created
get-if-exists by `get_or_create_coordinator` and restarted by Ray when it
dies (`max_restarts`; -1 = forever).

Surviving a restart. The index itself is not persisted: it is rebuilt from
the workers, who are the truth. What must survive is the list of workers, and
it is kept in Ray's GCS key-value store (`ray.experimental.internal_kv`,
namespace ``kvmesh-<namespace>``), which lives as long as the Ray cluster and
outside any actor: one msgpack record per worker, written on registration and
deleted on removal or expiry. On (re)start the actor reads those records,
re-registers the workers (their heartbeat clock starts now), asks every
worker that registered with a Ray actor name for a snapshot
(``await handle.snapshot.remote()``, see `kvmesh.coordinator.service`) and
applies them. Workers without an actor name, or whose snapshot failed, are
rebuilt the other way: their next `report` finds the index stale/empty and
the reply asks for a snapshot; a worker unknown to the registry gets
`UnknownWorker` and registers again.

torch.distributed links. `dist_link` opens a link of two workers for
``transport="dist"``: on first use the actor starts a TCP store (torch's,
on a free port, advertised at `CoordinatorConfig.rendezvous_host`), keys
each link under its own prefix (`kvmesh.rendezvous.LinkBook`: both workers'
ids and incarnations and an epoch), asks the serving worker's actor to join
(`dist_accept`) and returns the rendezvous to the asking worker. A restarted
coordinator starts a new store; links already open do not need it.

Background loop: every `heartbeat_interval_s` the actor expires workers
that missed heartbeats for `heartbeat_timeout_s` (dropping their index
entries and their GCS record) and asks stale workers with an actor name for
a snapshot. Every method is ``async``; object refs are awaited, never
``ray.get``-ed, and blocking GCS calls run in the default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack
import ray

from kvmesh.config import CoordinatorConfig, TransferConfig
from kvmesh.coordination import ReportMark, RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.grpc_api import CoordinatorAPIServer
from kvmesh.coordinator.index import MatchResult
from kvmesh.coordinator.policies import RouteDecision, RouteRequest, WorkerLoad
from kvmesh.coordinator.registry import WorkerInfo
from kvmesh.coordinator.service import (
    Coordinator,
    RebuildResult,
    Registration,
    ReportResult,
    RouteView,
)
from kvmesh.errors import KVMeshError, TransportError
from kvmesh.handles import CoordinatorHandle, WorkerActorHandle, handle_of
from kvmesh.logs import configure_logging, request_scope
from kvmesh.metrics import COORDINATOR_CALLS, REPORT_WAITS, in_ray_actor
from kvmesh.rendezvous import DistRendezvous, LinkBook
from kvmesh.types import PageHash, WorkerId

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger(__name__)
T = TypeVar("T")

SNAPSHOT_TIMEOUT_S = 30.0
"""How long a (re)starting coordinator waits for the workers' snapshots."""


def _kv_namespace(config: CoordinatorConfig) -> str:
    # No ':' here: Ray's internal KV lists keys of such a namespace mangled.
    return f"kvmesh-{config.namespace}"


def _kv_prefix(config: CoordinatorConfig) -> str:
    return f"{config.actor_name}/worker/"


class WorkerStore:
    """The registered workers' records in Ray's GCS key-value store (survives actor restarts)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.namespace = _kv_namespace(config)
        self.prefix = _kv_prefix(config)

    def put(self, reg: WorkerRegistration) -> None:
        from ray.experimental import internal_kv

        record = {f.name: getattr(reg, f.name) for f in dataclasses.fields(reg)}
        internal_kv._internal_kv_put(
            self.prefix + reg.worker_id,
            msgpack.packb(record, use_bin_type=True),
            overwrite=True,
            namespace=self.namespace,
        )

    def delete(self, worker_id: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self.prefix + worker_id, namespace=self.namespace)

    def load(self) -> list[dict[str, Any]]:
        """Every record that decodes; a corrupt one is logged and skipped."""
        from ray.experimental import internal_kv

        out: list[dict[str, Any]] = []
        for key in internal_kv._internal_kv_list(self.prefix, namespace=self.namespace):
            raw = internal_kv._internal_kv_get(key, namespace=self.namespace)
            if raw is None:
                continue
            try:
                rec = msgpack.unpackb(raw, raw=False)
                if not isinstance(rec, dict) or not isinstance(rec.get("worker_id"), str):
                    raise ValueError("not a worker record")
                out.append(rec)
            except Exception as exc:  # a corrupt record must not stop the restart
                log.warning("skipping unreadable worker record %r: %s", key, exc)
        return out


class CoordinatorActor:
    """Ray actor wrapping `Coordinator`; build it with `get_or_create_coordinator`."""

    def __init__(
        self,
        config: CoordinatorConfig,
        security: TransferConfig | None = None,
        *,
        ask_stale_snapshots: bool = True,
    ) -> None:
        # False for a shard with replicas: a snapshot it pulled would reach it alone (and
        # take a seq the other replicas then miss); its stale workers are told in the
        # report reply and send their snapshot through the routers to every replica.
        self.ask_stale_snapshots = ask_stale_snapshots
        self.config = config
        if in_ray_actor():  # this process is the actor's own: log as kvmesh does
            configure_logging()
        self.core = Coordinator(config)
        self._calls = {
            m: COORDINATOR_CALLS.labels(self.core.name, m)
            for m in ("route", "report", "heartbeat", "record_result", "view", "view_many")
        }
        self._api: CoordinatorAPIServer | None = None
        self.store = WorkerStore(config)
        self._ready = asyncio.Event()
        self._report_seen = asyncio.Event()  # replaced by a fresh one after every report
        self._snapshot_asked: dict[WorkerId, float] = {}
        self._links: LinkBook | None = None
        self._link_store: TCPStore | None = None  # torch's TCPStore serving every link's rendezvous
        self._links_lock = asyncio.Lock()
        loop = asyncio.get_running_loop()
        self._tasks: list[asyncio.Task[Any]] = [
            loop.create_task(self._recover()),
            loop.create_task(self._expire_loop()),
        ]
        if config.api_port >= 0:
            self._api = CoordinatorAPIServer(self, config, security or TransferConfig())
            self._api_start: asyncio.Task[int] = loop.create_task(self._api.start())
            self._tasks.append(self._api_start)

    async def _blocking(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def _recover(self) -> None:
        try:
            records = await self._blocking(self.store.load)
            for rec in records:
                try:
                    self.core.register_worker(WorkerRegistration(**rec))
                except Exception as exc:  # one bad record must not stop the others
                    log.warning("cannot restore worker %r: %s", rec.get("worker_id"), exc)
            if records:
                await self._ask_snapshots([WorkerId(r["worker_id"]) for r in records])
        finally:
            self._ready.set()

    async def _ask_snapshots(self, worker_ids: Sequence[WorkerId]) -> RebuildResult:
        """Fetch snapshots from the workers' actors (concurrently, with a deadline) and apply them."""
        loop = asyncio.get_running_loop()
        names: dict[WorkerId, tuple[str, str | None]] = {}
        for info in self.core.workers():
            if info.worker_id in worker_ids and info.actor_name:
                names[info.worker_id] = (info.actor_name, info.actor_namespace)
                self._snapshot_asked[info.worker_id] = loop.time()
        failed: dict[WorkerId, str] = {}

        async def fetch(wid: WorkerId, name: str, ns: str | None) -> bytes:
            handle: WorkerActorHandle = await self._blocking(
                lambda: ray.get_actor(name, namespace=ns)
            )
            ref = handle.snapshot.remote()
            data: bytes = await asyncio.wait_for(ref, SNAPSHOT_TIMEOUT_S)
            return data

        wids = list(names)
        results = await asyncio.gather(*(fetch(w, *names[w]) for w in wids), return_exceptions=True)
        snaps: dict[WorkerId, bytes] = {}
        for wid, res in zip(wids, results, strict=True):
            if isinstance(res, BaseException):
                failed[wid] = f"{type(res).__name__}: {res}"
            else:
                snaps[wid] = res
        rebuilt = self.core.rebuild_from_snapshots(snaps)
        self._reports_applied()  # a snapshot takes a seq: routes may wait for it
        rebuilt.failed.update(failed)
        if rebuilt.failed:
            log.warning("snapshots failed for %s", sorted(rebuilt.failed))
        return rebuilt

    async def _expire_loop(self) -> None:
        interval = max(self.config.heartbeat_interval_s, 0.01)
        await self._ready.wait()
        while True:
            await asyncio.sleep(interval)
            try:
                for wid in self.core.expire():
                    self._snapshot_asked.pop(wid, None)
                    await self._blocking(self.store.delete, wid)
                if not self.ask_stale_snapshots:
                    continue
                now = asyncio.get_running_loop().time()
                due = [
                    w
                    for w in self.core.workers_needing_snapshot()
                    if now - self._snapshot_asked.get(w, -1e9) > self.config.heartbeat_timeout_s
                ]
                if due:
                    await self._ask_snapshots(due)
            except Exception:  # the loop must outlive any one failure
                log.exception("coordinator background loop failed; continuing")

    # ---------------------------------------------------------------- API

    async def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """True once the start-up rebuild from worker snapshots has finished."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        return self._ready.is_set()

    async def register_worker(self, reg: WorkerRegistration) -> Registration:
        out = self.core.register_worker(reg)
        await self._blocking(self.store.put, reg)
        return out

    async def report(self, report: WorkerReport) -> ReportResult:
        """A worker's events, load and request outcomes (`Coordinator.report`): the one
        call a request costs a worker, sent without waiting for the reply."""
        self._calls["report"].inc()
        try:
            return self.core.report(report)
        finally:
            self._reports_applied()

    async def heartbeat(self, worker_id: WorkerId, load: WorkerLoad | None = None) -> ReportResult:
        self._calls["heartbeat"].inc()
        return self.core.heartbeat(worker_id, load)

    def _reports_applied(self) -> None:
        """Wake the routes waiting for reports (`_wait_reported`)."""
        self._report_seen.set()
        self._report_seen = asyncio.Event()

    async def _wait_reported(self, marks: Sequence[ReportMark]) -> None:
        """Until every mark's batch is applied, for at most `heartbeat_interval_s`: the
        worker sent it before its answer, so it is on its way; past that it was lost (the
        worker resends with its next heartbeat) and the route goes on without it."""
        if not marks or self.core.reported(marks):
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + self.config.heartbeat_interval_s
        while not self.core.reported(marks):
            left = until - loop.time()
            if left <= 0:
                REPORT_WAITS.labels(self.core.name, "timed_out").inc()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._report_seen.wait(), left)
        REPORT_WAITS.labels(self.core.name, "waited").inc()

    async def route(self, query: RouteQuery) -> RouteDecision:
        """The one call a request costs its client (`Coordinator.route`), once the reports
        it follows (`query.after`) are applied."""
        self._calls["route"].inc()
        with request_scope(query.request_id):  # its id on our logs and on the error we raise
            await self._wait_reported(query.check().after)  # unpickled: no constructor ran
            return self.core.route(query)

    async def count_routed(self, decision: RouteDecision, request: RouteRequest) -> None:
        """A router in front of shards routed a request to one of this shard's workers."""
        self.core.count_routed(decision, request)

    async def match(self, hashes: Sequence[PageHash]) -> MatchResult:
        return self.core.match(hashes)

    async def view(self, query: RouteQuery, known_loads_version: int | None = None) -> RouteView:
        """Overlaps and loads for a router in front of shards; waits for the start-up rebuild
        and for the reports the query follows (`query.after`, the marks of this shard's
        workers). Loads of `known_loads_version` (the router holds them) are left out.

        A shard answers only once its index is rebuilt from the workers'
        snapshots, so a restarted shard never hands a router a half-empty
        index (that would be a wrong answer, not a slow one).
        """
        self._calls["view"].inc()
        await self._ready.wait()
        await self._wait_reported(query.after)
        return self.core.view(query, known_loads_version)

    async def view_many(
        self, queries: Sequence[RouteQuery], known_loads_version: int | None = None
    ) -> list[RouteView]:
        """`view` of each query in one call and one lookup (`Coordinator.view_many`): what a
        router asks for the routes that arrived while its last fan-out was in flight."""
        self._calls["view_many"].inc()
        await self._ready.wait()
        await self._wait_reported([m for query in queries for m in query.after])
        return self.core.view_many(queries, known_loads_version)

    async def address_of(self, worker_id: WorkerId) -> str:
        """The worker's serving address; raises `UnknownWorker`."""
        return self.core.registry_info(worker_id).address

    async def health(self) -> dict[str, Any]:
        return {
            "serving": self._ready.is_set(),
            "workers": len(self.core.workers()),
            "shards": 1,
            "replicas": 1,
        }

    async def api_address(self) -> str | None:
        """host:port of the gRPC routing API this actor serves (None: not served)."""
        if self._api is None:
            return None
        await self._api_start  # raises what binding raised (a port in use, bad TLS files)
        return self._api.address

    async def record_result(
        self, promised_local: int, promised_pull: int, realized_local: int, realized_pull: int
    ) -> bool:
        """One outcome on its own (tools, the gRPC API); workers send theirs with `report`."""
        self._calls["record_result"].inc()
        return self.core.record_result(promised_local, promised_pull, realized_local, realized_pull)

    async def calls(self) -> dict[str, int]:
        """How many calls of each counted method this coordinator served (its metric
        ``kvmesh_coordinator_calls``): what a request costs, seen from here."""
        counts = COORDINATOR_CALLS.values_by("method", coordinator=self.core.name)
        return {method: int(n) for method, n in counts.items()}

    async def stats(self, after: Sequence[ReportMark] = ()) -> dict[str, Any]:
        """The counters, once the reports `after` names are applied (a client reading its
        own requests' outcomes; at most a heartbeat interval, as a route)."""
        await self._wait_reported(after)
        return self.core.stats().as_dict()

    async def workers(self) -> list[WorkerInfo]:
        return self.core.workers()

    async def drain_worker(self, worker_id: WorkerId, draining: bool = True) -> None:
        self.core.drain_worker(worker_id, draining)

    async def remove_worker(self, worker_id: WorkerId) -> bool:
        removed = self.core.remove_worker(worker_id)
        await self._blocking(self.store.delete, worker_id)
        return removed

    async def rebuild(self) -> RebuildResult:
        """Ask every registered worker with an actor name for a snapshot now."""
        return await self._ask_snapshots([i.worker_id for i in self.core.workers()])

    async def snapshot_index(self) -> bytes:
        return self.core.snapshot_index()

    async def pid(self) -> int:
        """The actor's process id (a restarted actor has a new one)."""
        return os.getpid()

    async def node_id(self) -> str:
        """The Ray node this actor runs on (placement checks)."""
        return str(ray.get_runtime_context().get_node_id())

    async def dist_link(self, client_id: WorkerId, server_address: str) -> DistRendezvous:
        """Open a torch.distributed link from worker `client_id` to the worker at `server_address`.

        Asks the server's actor to join (`WorkerActor.dist_accept`, which
        returns once its joining thread runs) and returns the rendezvous for
        the client to join too. Raises `UnknownWorker` for an unregistered end,
        `TransportError` when the server cannot be asked or refuses.
        """
        book = await self._link_book()
        rdv, server = self.core.open_link(book, client_id, server_address)
        if not server.actor_name:
            raise TransportError(
                f"worker {server.worker_id!r} has no Ray actor to ask to join a link; "
                "use transport='grpc' for it"
            )
        name, ns = server.actor_name, server.actor_namespace
        try:
            handle: WorkerActorHandle = await self._blocking(
                lambda: ray.get_actor(name, namespace=ns)
            )
            await asyncio.wait_for(
                handle.dist_accept.remote(rdv), self.config.link_accept_timeout_s
            )
        except KVMeshError:
            raise
        except Exception as exc:  # gone, timed out, or refused through Ray
            cause = getattr(exc, "cause", None)
            if isinstance(cause, KVMeshError):
                raise cause from None
            raise TransportError(
                f"worker {server.worker_id!r} did not accept a torch.distributed link: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return rdv

    async def _link_book(self) -> LinkBook:
        """The links' rendezvous store, started on first use on a free port."""
        async with self._links_lock:
            if self._links is None:
                self._links = await self._blocking(self._host_link_store)
            return self._links

    def _host_link_store(self) -> LinkBook:
        from kvmesh.rendezvous import host_link_store

        host = self.config.rendezvous_host or ray.util.get_node_ip_address()
        self._link_store, book = host_link_store(host)
        log.info("torch.distributed link store at %s:%d", host, book.master_port)
        return book


def get_or_create_coordinator(
    config: CoordinatorConfig | None = None, security: TransferConfig | None = None
) -> CoordinatorHandle:
    """The cluster's coordinator actor handle, creating it if it does not exist yet.

    Needs `ray.init()` first. The actor takes no CPU slot (it is mostly idle
    between small calls), is restarted up to `max_restarts` times, and calls
    made while it restarts are retried. With `index_shards` or
    `router_replicas` above 1 the handle is router replica 0's, in front of
    the shard actors (`kvmesh.coordinator.router`). `security` (TLS, token)
    is for the gRPC routing API when `api_port` >= 0.
    """
    cfg = config or CoordinatorConfig()
    if cfg.index_shards > 1 or cfg.router_replicas > 1:
        # router.py builds on this module (its shards are CoordinatorActors): imported here
        from kvmesh.coordinator.router import create_layout

        return create_layout(cfg, security)[0]
    options: dict[str, Any] = {
        "name": cfg.actor_name,
        "namespace": cfg.namespace,
        "get_if_exists": True,
        "max_restarts": cfg.max_restarts,
        "max_task_retries": 3,
        "num_cpus": 0,
        "max_concurrency": 64,
    }
    if cfg.detached:
        options["lifetime"] = "detached"
    return handle_of(ray.remote(CoordinatorActor).options(**options).remote(cfg, security))
