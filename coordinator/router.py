"""Index shards and router replicas on Ray: the coordinator at scale.

With ``CoordinatorConfig.index_shards`` = N and ``router_replicas`` = M,
`get_or_create_coordinator` starts M x N shard actors and M routers:

    replica 0:  router "kvmesh-coordinator"          shards "kvmesh-coordinator-r0-s0" .. -s{N-1}
    replica 1:  router "kvmesh-coordinator-router-1" shards "kvmesh-coordinator-r1-s0" .. -s{N-1}

A shard is a `CoordinatorActor` under its own name: registry, index, stale
detection, snapshots, incarnations and the GCS worker records for the
workers placed on it (`shards.shard_of`), restarted by Ray and rebuilt from
its workers' snapshots before it answers (`CoordinatorActor.view` waits).

A router (`RouterActor`) has the coordinator actor's API, so workers, the
client and the gRPC API use it unchanged:

- what changes state (register, report, heartbeat, drain, remove) goes to the
  worker's shard in EVERY replica, in the order the worker sent it: each
  replica is fed the same events, never its own routing history. A reply
  comes once every live replica has applied it; a kvmesh error of any
  replica (``UnknownWorker`` after a replica lost the worker) goes back to
  the worker, whose answer (register again, send a snapshot) heals that
  replica too. A replica that is down misses nothing: it rebuilds from
  snapshots when Ray restarts it;
- a route asks its own replica's shards, in parallel, and decides with
  `shards.ShardRouter` (random choices seeded per request, so replicas
  decide alike). Routes that arrive while a fan-out is in flight go out
  together when it ends, one `view_many` call per shard (`RouterActor.view`),
  and a shard sends its loads only when their version changed since this
  router last held them (`Coordinator.loads_version`). A shard that fails or
  has not answered within its hedge delay (`HedgeDelay`: four times its
  usual answer time, 50-250 ms) is asked in the other replicas too; the
  first answer wins;
- a new replica (`create_layout` again with a larger `router_replicas`)
  catches up before it routes: each of its shards registers the workers its
  sibling shards know and asks them for snapshots (`RouterActor.wait_ready`);
  the running routers find it within a heartbeat interval and feed it from
  then on (events it missed in between are a seq gap: the shard marks the
  worker stale and asks it for a snapshot, as for any gap).

torch.distributed links (`dist_link`) are opened by the asking worker's
shard, so both ends must live in one shard (else ``UnknownWorker``): use
``transport="grpc"`` with more than one shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from kvmesh.config import CoordinatorConfig, TransferConfig
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.actor import CoordinatorActor
from kvmesh.coordinator.grpc_api import CoordinatorAPIServer
from kvmesh.coordinator.index import MatchResult
from kvmesh.coordinator.policies import RouteDecision, RouteRequest, WorkerLoad
from kvmesh.coordinator.registry import WorkerInfo
from kvmesh.coordinator.service import (
    RebuildResult,
    Registration,
    ReportResult,
    RouteView,
    policy_request,
)
from kvmesh.coordinator.shards import (
    MergedLoads,
    ShardRouter,
    SlowShards,
    merge_matches,
    merge_stats,
    merge_view_batches,
    shard_of,
)
from kvmesh.errors import InvalidInput, KVMeshError, TransportError
from kvmesh.events import ApplyResult
from kvmesh.handles import CoordinatorHandle, WorkerActorHandle, handle_of
from kvmesh.logs import request_scope
from kvmesh.metrics import REPLICA_FAILOVERS
from kvmesh.rendezvous import DistRendezvous
from kvmesh.requests import ReportMark, Role
from kvmesh.router_replicas import router_actor_name, shard_actor_name
from kvmesh.types import PageHash, WorkerId

log = logging.getLogger(__name__)

HEDGE_AFTER_S = 0.25
"""The longest a route waits for its own replica's shard before asking the other replicas too."""
HEDGE_FLOOR_S = 0.05
"""The shortest: below it, a busy machine's ordinary jitter would hedge most routes."""


class HedgeDelay:
    """How long a route waits for its own replica's shard: past what is normal for it.

    `factor` times a moving average of that shard's answers, within
    [`floor_s`, `ceiling_s`]; the ceiling until it has answered once. A shard
    answering in 5 ms is given 50 ms, not 250, so a killed shard costs its
    first route a fifth of the wait. Pure; one router's event loop uses it.
    """

    def __init__(
        self,
        floor_s: float = HEDGE_FLOOR_S,
        ceiling_s: float = HEDGE_AFTER_S,
        factor: float = 4.0,
        weight: float = 0.1,
    ) -> None:
        if not 0 < floor_s <= ceiling_s or factor <= 0 or not 0 < weight <= 1:
            raise InvalidInput(
                f"hedge delay needs 0 < floor_s <= ceiling_s, factor > 0, 0 < weight <= 1; "
                f"got {floor_s}, {ceiling_s}, {factor}, {weight}"
            )
        self.floor_s, self.ceiling_s, self.factor, self.weight = floor_s, ceiling_s, factor, weight
        self._mean_s: dict[int, float] = {}

    def observe(self, shard: int, seconds: float) -> None:
        """`shard` answered in `seconds`."""
        mean = self._mean_s.get(shard)
        self._mean_s[shard] = seconds if mean is None else mean + self.weight * (seconds - mean)

    def delay(self, shard: int) -> float:
        mean = self._mean_s.get(shard)
        if mean is None:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.factor * mean))


SHARD_CALL_TIMEOUT_S = 30.0
"""The longest a router waits for any shard (a restarting shard rebuilds first)."""
REPLICA_CALL_TIMEOUT_S = 2.0
"""With replicas, how long a state change waits for one replica before skipping it."""
_GONE = (ActorDiedError, ActorUnavailableError, RayActorError, TimeoutError)


def _kvmesh_cause(exc: BaseException) -> KVMeshError | None:
    """The kvmesh error a remote call raised (Ray wraps it), if that is what failed."""
    if isinstance(exc, KVMeshError):
        return exc
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, KVMeshError) else None


def _check_hashes(hashes: Sequence[object]) -> None:
    """Refuse a route's page hashes that are not 1-64 bytes each (`InvalidInput`); C-level
    passes while all are good."""
    if hashes and (
        set(map(type, hashes)) != {bytes}
        or min(map(len, hashes)) == 0  # type: ignore[arg-type]
        or max(map(len, hashes)) > 64  # type: ignore[arg-type]
    ):
        for h in hashes:
            if type(h) is not bytes or not 0 < len(h) <= 64:
                raise InvalidInput(f"a page hash must be 1-64 bytes, got {h!r:.40}")


def _placement(config: CoordinatorConfig, replica: int) -> dict[str, Any]:
    """Ray options placing replica `replica`'s actors: on nodes labelled for it, if configured."""
    if config.replica_node_label:
        return {"label_selector": {config.replica_node_label: str(replica)}}
    return {}


class RouterActor:
    """One router replica; see the module docstring. Build them with `get_or_create_coordinator`."""

    def __init__(
        self,
        config: CoordinatorConfig,
        replica: int,
        security: TransferConfig | None = None,
        shards: Sequence[Sequence[CoordinatorHandle]] = (),
        peers: Sequence[CoordinatorHandle] = (),
    ) -> None:
        self.config = config
        self.replica = replica
        self.num_shards = config.index_shards
        self.num_replicas = config.router_replicas
        # per-request random choices always: replicas (now or added later) decide alike
        self.router = ShardRouter(config, per_request_rng=True)
        # Ray collects an actor nobody holds a handle to: the routers hold their shards'
        # (`shards[replica][shard]`, from `create_layout`; Ray keeps them across restarts)
        self._handles: dict[tuple[int, int], CoordinatorHandle] = {
            (r, s): h for r, row in enumerate(shards) for s, h in enumerate(row)
        }
        self._peers = list(peers)  # replica 0 holds the other routers (the same reason)
        self._addresses: dict[WorkerId, str] = {}
        self._down_until: dict[int, float] = {}  # replica -> loop time it is skipped until
        self._slow = SlowShards(max(config.heartbeat_interval_s, HEDGE_AFTER_S))
        self._hedge = HedgeDelay()
        self._background: set[asyncio.Task[Any]] = set()  # routed-load updates under way
        # views asked while a fan-out is in flight go out together when it ends (`view`)
        self._asked: list[tuple[RouteQuery, asyncio.Future[RouteView]]] = []
        self._fanning_out = False
        # per shard: the loads version of its last answer and its loads per role, so a
        # shard sends them only when they changed; their merge is kept while they last
        self._shard_loads: dict[int, tuple[int, dict[Role | None, tuple[WorkerLoad, ...]]]] = {}
        self._merged_loads = MergedLoads()
        self._ready = asyncio.Event()
        self._api: CoordinatorAPIServer | None = None
        loop = asyncio.get_running_loop()
        self._tasks: list[asyncio.Task[Any]] = [
            loop.create_task(self._catch_up()),
            loop.create_task(self._discover_loop()),
        ]
        if config.api_port >= 0:
            self._api = CoordinatorAPIServer(self, config, security or TransferConfig())
            self._api_start: asyncio.Task[int] = loop.create_task(self._api.start())
            self._tasks.append(self._api_start)

    # ---------------------------------------------------------------- shards

    async def _shard(self, replica: int, shard: int) -> CoordinatorHandle:
        key = (replica, shard)
        handle = self._handles.get(key)
        if handle is None:
            name = shard_actor_name(self.config, replica, shard)
            ns = self.config.namespace
            loop = asyncio.get_running_loop()
            found: CoordinatorHandle = await loop.run_in_executor(
                None, lambda: ray.get_actor(name, namespace=ns)
            )
            handle = self._handles[key] = found
        return handle

    async def _call(
        self, replica: int, shard: int, method: str, *args: Any, timeout_s: float | None = None
    ) -> Any:
        handle = await self._shard(replica, shard)
        ref = getattr(handle, method).remote(*args)
        return await asyncio.wait_for(ref, timeout_s or SHARD_CALL_TIMEOUT_S)

    async def _everywhere(self, shard: int, method: str, *args: Any) -> list[Any]:
        """Call `method` on `shard` of every live replica; their answers, own first.

        A replica that fails or does not answer within ``REPLICA_CALL_TIMEOUT_S``
        (its node is gone, its shard restarts) is skipped for
        ``heartbeat_timeout_s``: what it misses meanwhile is a seq gap it heals
        by snapshot when it is back. With one replica the call waits for a
        restarting shard instead. Raises the first kvmesh error any replica
        raised, or `TransportError` when no replica answered.
        """
        loop = asyncio.get_running_loop()
        now = loop.time()
        order = [self.replica] + [r for r in range(self.num_replicas) if r != self.replica]
        live = [r for r in order if self._down_until.get(r, 0.0) <= now] or order
        timeout = REPLICA_CALL_TIMEOUT_S if self.num_replicas > 1 else SHARD_CALL_TIMEOUT_S
        results = await asyncio.gather(
            *(self._call(r, shard, method, *args, timeout_s=timeout) for r in live),
            return_exceptions=True,
        )
        answers: list[Any] = []
        gone: list[str] = []
        for r, res in zip(live, results, strict=True):
            if isinstance(res, BaseException):
                cause = _kvmesh_cause(res)
                if cause is not None:
                    raise cause
                if not isinstance(res, (*_GONE, ValueError)):
                    raise res
                gone.append(f"replica {r}: {type(res).__name__}")
                if r not in self._down_until or self._down_until[r] <= now:
                    log.warning("router %d: replica %d is away (%s)", self.replica, r, gone[-1])
                    REPLICA_FAILOVERS.labels(reason="replica_down").inc()
                self._down_until[r] = loop.time() + self.config.heartbeat_timeout_s
            else:
                self._down_until.pop(r, None)
                answers.append(res)
        if not answers:
            raise TransportError(f"no replica of index shard {shard} answered ({'; '.join(gone)})")
        return answers

    async def _hedged(self, shard: int, method: str, *args: Any) -> Any:
        """`method` on this replica's `shard`; if it fails or is slow, the first other replica's.

        A shard that was late or failed (`SlowShards`) is asked in every
        replica at once until it answers first again, so a restarting shard
        costs its routes one hedge delay, not one each.
        """
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        own: asyncio.Future[Any] = asyncio.ensure_future(
            self._call(self.replica, shard, method, *args)
        )

        def answered(f: asyncio.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                self._hedge.observe(shard, loop.time() - t0)

        own.add_done_callback(answered)
        pending: set[asyncio.Future[Any]] = {own}
        # own replica known to be away (state changes skip it): ask the others at once
        away = self._down_until.get(self.replica, 0.0) > loop.time()
        slow = self.num_replicas > 1 and (away or self._slow.is_slow(shard))
        await asyncio.wait(pending, timeout=0 if slow else self._hedge.delay(shard))
        if not own.done() or own.exception() is not None:
            REPLICA_FAILOVERS.labels(reason="hedged").inc()
            if not slow:  # it had its hedge delay and missed it (asked at once, it could not)
                self._slow.mark(shard)
            pending |= {
                asyncio.ensure_future(self._call(r, shard, method, *args))
                for r in range(self.num_replicas)
                if r != self.replica
            }
        errors: list[BaseException] = []
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    exc = fut.exception()
                    if exc is None:
                        if fut is own:
                            self._slow.clear(shard)
                        return fut.result()
                    cause = _kvmesh_cause(exc)
                    if cause is not None:
                        raise cause
                    errors.append(exc)
                REPLICA_FAILOVERS.labels(reason="shard_failed").inc()
        finally:
            for p in pending:
                p.cancel()
        raise TransportError(
            f"no replica of index shard {shard} answered: "
            + "; ".join(f"{type(e).__name__}: {e}" for e in errors)
        )

    async def _discover_loop(self) -> None:
        """Find replicas added after this router started (every heartbeat interval)."""
        while True:
            await asyncio.sleep(max(self.config.heartbeat_interval_s, 0.05))
            try:
                await self._discover()
            except Exception:  # the loop must outlive any one failure
                log.exception("router replica %d: replica discovery failed", self.replica)

    async def _discover(self) -> None:
        n = self.num_replicas
        while True:
            try:
                await self._shard(n, 0)
            except ValueError:  # no such actor: replica n does not exist
                break
            n += 1
        if n != self.num_replicas:
            log.info("router replica %d now feeds %d replicas", self.replica, n)
            self.num_replicas = n

    async def _catch_up(self) -> None:
        """Register on this replica's shards the workers their siblings know; feed their snapshots.

        The snapshots are asked from the workers by this router and sent to
        the worker's shard in every replica (a snapshot takes the worker's
        next seq: applied by one replica alone, it would be a gap for the
        others).
        """
        try:
            for shard in range(self.num_shards):
                own = {i.worker_id: i for i in await self._call(self.replica, shard, "workers")}
                missing: dict[WorkerId, WorkerInfo] = {}
                for r in range(self.num_replicas):
                    if r == self.replica:
                        continue
                    with contextlib.suppress(*_GONE, ValueError):
                        for info in await self._call(r, shard, "workers"):
                            mine = own.get(info.worker_id)
                            if mine is None or mine.incarnation != info.incarnation:
                                missing.setdefault(info.worker_id, info)
                for info in missing.values():
                    await self._call(self.replica, shard, "register_worker", info.registration)
                    await self._feed_snapshot(shard, info)
                if missing:
                    log.info(
                        "replica %d shard %d caught up %d workers",
                        self.replica,
                        shard,
                        len(missing),
                    )
        except Exception:  # the router must come up; routes then wait on the shards
            log.exception("router replica %d could not catch up from its siblings", self.replica)
        finally:
            self._ready.set()

    async def _feed_snapshot(self, shard: int, info: WorkerInfo) -> None:
        """Ask a worker's actor for its snapshot and report it to every replica's `shard`.

        A worker without an actor (an engine on the gRPC API) is left to its
        next report: the shard finds it without events and asks for a snapshot
        in the reply.
        """
        if not info.actor_name:
            return
        name, ns = info.actor_name, info.actor_namespace
        try:
            loop = asyncio.get_running_loop()
            handle: WorkerActorHandle = await loop.run_in_executor(
                None, lambda: ray.get_actor(name, namespace=ns)
            )
            data: bytes = await asyncio.wait_for(handle.snapshot.remote(), SHARD_CALL_TIMEOUT_S)
            await self._everywhere(shard, "report", WorkerReport(info.worker_id, (data,)))
        except Exception as exc:  # one worker's failure must not stop the others
            log.warning("no snapshot from %s for catch-up: %s", info.worker_id, exc)

    # ---------------------------------------------------------------- API (as CoordinatorActor)

    async def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """True once this replica caught up and every one of its shards is rebuilt."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        if not self._ready.is_set():
            return False
        oks = await asyncio.gather(
            *(self._call(self.replica, s, "wait_ready", timeout_s) for s in range(self.num_shards)),
            return_exceptions=True,
        )
        return all(ok is True for ok in oks)

    async def register_worker(self, reg: WorkerRegistration) -> Registration:
        shard = shard_of(reg.check().worker_id, self.num_shards)
        regs: list[Registration] = await self._everywhere(shard, "register_worker", reg)
        self._addresses[reg.worker_id] = reg.address
        return dataclasses.replace(regs[0], needs_snapshot=any(r.needs_snapshot for r in regs))

    async def report(self, report: WorkerReport) -> ReportResult:
        """The worker's shard applies its batches on every replica; its request outcomes
        are counted once, where `record_result` counts them."""
        shard = shard_of(report.check().worker_id, self.num_shards)
        events_only = dataclasses.replace(report, outcomes=())
        replies: list[ReportResult] = await self._everywhere(shard, "report", events_only)
        for o in report.outcomes:
            await self.record_result(
                o.promised_local, o.promised_pull, o.realized_local, o.realized_pull
            )
        return ReportResult(replies[0].results, any(r.needs_snapshot for r in replies))

    async def heartbeat(self, worker_id: WorkerId, load: WorkerLoad | None = None) -> ReportResult:
        return await self.report(WorkerReport(worker_id, (), load))

    async def drain_worker(self, worker_id: WorkerId, draining: bool = True) -> None:
        await self._everywhere(
            shard_of(worker_id, self.num_shards), "drain_worker", worker_id, draining
        )

    async def remove_worker(self, worker_id: WorkerId) -> bool:
        removed = await self._everywhere(
            shard_of(worker_id, self.num_shards), "remove_worker", worker_id
        )
        self._addresses.pop(worker_id, None)
        return any(removed)

    async def view(self, query: RouteQuery) -> RouteView:
        """Every shard's view, merged (own replica first, hedged to the others); each shard
        waits only for the reports of its own workers (`query.after`).

        Views asked while a fan-out is in flight wait for it to end and then go
        to the shards together, one `view_many` call per shard for them all, so
        a busy router pays each shard's per-call cost (Ray's and the lookup's)
        once per batch, not once per route. Each is answered with its own view,
        as `ShardedCoordinator.route_many` does; a request routed in one batch
        counts in its worker's load for the batches after it.
        """
        _check_hashes(query.hashes)  # a bad one would fail the batch it joins, not itself alone
        await self._ready.wait()
        view: asyncio.Future[RouteView] = asyncio.get_running_loop().create_future()
        self._asked.append((query, view))
        if not self._fanning_out:
            self._fanning_out = True
            task = asyncio.get_running_loop().create_task(self._fan_out())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return await view

    async def _fan_out(self) -> None:
        """Send the views asked so far to the shards, batch after batch, until none wait."""
        batch: list[tuple[RouteQuery, asyncio.Future[RouteView]]] = []
        try:
            while self._asked:
                batch, self._asked = self._asked, []
                answers = await self._answers([query for query, _ in batch])
                for (_, view), answer in zip(batch, answers, strict=True):
                    if view.done():  # its caller is gone (cancelled)
                        continue
                    if isinstance(answer, BaseException):
                        view.set_exception(answer)
                    else:
                        view.set_result(answer)
        except BaseException:  # cancelled (the actor stops): no caller is left waiting
            for _, view in [*batch, *self._asked]:
                view.cancel()
            raise
        finally:
            self._fanning_out = False

    async def _answers(self, queries: Sequence[RouteQuery]) -> list[RouteView | BaseException]:
        """Each query's merged view, or the error that stopped it: a batch a shard refuses is
        asked again one query at a time, so that one query's fault fails that query alone."""
        try:
            return list(await self._views(queries))
        except TransportError as exc:  # no replica of a shard answered: no view can come
            return [exc] * len(queries)
        except Exception as exc:
            if len(queries) == 1:
                return [exc]
            one_by_one = await asyncio.gather(
                *(self._views([query]) for query in queries), return_exceptions=True
            )
            return [v if isinstance(v, BaseException) else v[0] for v in one_by_one]

    async def _views(self, queries: Sequence[RouteQuery]) -> list[RouteView]:
        """The merged views of `queries`: one `view_many` call per shard, each shard's loads
        sent only when they changed since this router last held them."""
        per_shard = await asyncio.gather(
            *(self._shard_views(s, queries) for s in range(self.num_shards))
        )
        return merge_view_batches(per_shard, self._merged_loads)

    async def _shard_views(self, shard: int, queries: Sequence[RouteQuery]) -> list[RouteView]:
        """`shard`'s views of `queries` (hedged), each with the loads tuple this router holds
        for that shard's loads version, so that an unchanged shard's loads are neither sent
        nor merged again."""
        held = self._shard_loads.get(shard)
        known = None
        if held is not None and {query.role for query in queries} <= held[1].keys():
            known = held[0]
        mine = [self._for_shard(query, shard) for query in queries]
        views: list[RouteView] = await self._hedged(shard, "view_many", mine, known)
        if not views:
            return views
        version = views[0].loads_version  # one call: one version (another replica's, hedged)
        if held is None or held[0] != version:
            held = self._shard_loads[shard] = (version, {})
        loads = held[1]
        out = []
        for query, view in zip(queries, views, strict=True):
            cached = loads.get(query.role)
            if cached is None:
                loads[query.role] = view.loads
            elif view.loads is not cached:  # left out, or sent again: the same loads
                view = dataclasses.replace(view, loads=cached)
            out.append(view)
        return out

    def _for_shard(self, query: RouteQuery, shard: int) -> RouteQuery:
        """`query` with only the report marks of `shard`'s workers (the others are not its)."""
        if not query.after or self.num_shards == 1:
            return query
        mine = tuple(m for m in query.after if self._shard_of(m) == shard)
        return dataclasses.replace(query, after=mine)

    def _shard_of(self, mark: ReportMark) -> int:
        return shard_of(mark.worker_id, self.num_shards)

    async def route(self, query: RouteQuery) -> RouteDecision:
        if query.check().split:  # both halves at once, each its own fan-out
            prefill, decode = await asyncio.gather(*(self.route(q) for q in query.halves()))
            return dataclasses.replace(prefill, decode=decode)
        with request_scope(query.request_id):  # its id on our logs and on the error we raise
            view = await self.view(query.check())
            decision = self.router.decide(query, view)
        if query.request_id:  # a request on its way: its load counts it (`Coordinator.route`)
            self._count_routed(decision, policy_request(query))
        return decision

    def _count_routed(self, decision: RouteDecision, request: RouteRequest) -> None:
        """Tell the chosen worker's shard in every replica, as a state change, without
        holding the reply: replicas see the same increments (not their own routes only)."""
        shard = shard_of(decision.worker_id, self.num_shards)
        task = asyncio.get_running_loop().create_task(
            self._everywhere(shard, "count_routed", decision, request)
        )
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "router %d: a routed request was not counted: %s", self.replica, task.exception()
            )

    async def match(self, hashes: Sequence[PageHash]) -> MatchResult:
        results = await asyncio.gather(
            *(self._hedged(s, "match", list(hashes)) for s in range(self.num_shards))
        )
        return merge_matches(results)

    async def record_result(
        self, promised_local: int, promised_pull: int, realized_local: int, realized_pull: int
    ) -> bool:
        mismatch: bool = await self._hedged(
            0, "record_result", promised_local, promised_pull, realized_local, realized_pull
        )
        return mismatch

    async def stats(self, after: Sequence[ReportMark] = ()) -> dict[str, Any]:
        marks = tuple(after)
        shard_stats = await asyncio.gather(
            *(
                self._hedged(s, "stats", tuple(m for m in marks if self._shard_of(m) == s))
                for s in range(self.num_shards)
            )
        )
        out = merge_stats(shard_stats, self.router.stats())
        out["shards"] = self.num_shards
        out["replicas"] = self.num_replicas
        return out

    async def workers(self) -> list[WorkerInfo]:
        infos = await asyncio.gather(*(self._hedged(s, "workers") for s in range(self.num_shards)))
        return sorted((i for part in infos for i in part), key=lambda i: i.worker_id)

    async def address_of(self, worker_id: WorkerId) -> str:
        address = self._addresses.get(worker_id)
        if address is None:
            address = await self._hedged(
                shard_of(worker_id, self.num_shards), "address_of", worker_id
            )
            self._addresses[worker_id] = address
        return address

    async def rebuild(self) -> RebuildResult:
        """Every shard of every replica asks its workers for snapshots now."""
        applied: dict[WorkerId, ApplyResult] = {}
        failed: dict[WorkerId, str] = {}
        for s in range(self.num_shards):
            for r in await self._everywhere(s, "rebuild"):
                applied.update(r.applied)
                failed.update(r.failed)
        return RebuildResult(applied, failed)

    async def health(self) -> dict[str, Any]:
        ready = await self.wait_ready(0.5)
        workers = await self.workers() if ready else []
        return {
            "serving": ready,
            "workers": len(workers),
            "shards": self.num_shards,
            "replicas": self.num_replicas,
        }

    async def api_address(self) -> str | None:
        if self._api is None:
            return None
        await self._api_start  # raises what binding raised (a port in use, bad TLS files)
        return self._api.address

    async def pid(self) -> int:
        return os.getpid()

    async def node_id(self) -> str:
        """The Ray node this router runs on (placement checks)."""
        return str(ray.get_runtime_context().get_node_id())

    async def dist_link(self, client_id: WorkerId, server_address: str) -> DistRendezvous:
        """Opened by the client's shard (both ends must be in one shard; see the module docstring)."""
        rdv: DistRendezvous = await self._call(
            self.replica,
            shard_of(client_id, self.num_shards),
            "dist_link",
            client_id,
            server_address,
        )
        return rdv


def create_layout(
    config: CoordinatorConfig, security: TransferConfig | None = None
) -> list[ActorHandle[RouterActor]]:
    """Start (get-if-exists) every shard and router actor; returns the routers' handles, replica 0 first.

    Shards first, so that a router's catch-up finds its siblings. No actor
    takes a CPU slot; replica `r`'s actors go to nodes labelled
    ``replica_node_label=r`` when that is set, and shards spread over nodes.
    """
    common: dict[str, Any] = {
        "namespace": config.namespace,
        "get_if_exists": True,
        "max_restarts": config.max_restarts,
        "max_task_retries": 3,
        "num_cpus": 0,
        "max_concurrency": 64,
    }
    if config.detached:
        common["lifetime"] = "detached"
    shard_cfg = dataclasses.replace(config, index_shards=1, router_replicas=1, api_port=-1)
    shards: list[list[ActorHandle[CoordinatorActor]]] = []
    for r in range(config.router_replicas):
        row: list[ActorHandle[CoordinatorActor]] = []
        for s in range(config.index_shards):
            cfg = dataclasses.replace(shard_cfg, actor_name=shard_actor_name(config, r, s))
            options = {**common, "name": cfg.actor_name, **_placement(config, r)}
            if "label_selector" not in options:
                options["scheduling_strategy"] = "SPREAD"
            replicated = config.router_replicas > 1
            row.append(
                handle_of(
                    ray.remote(CoordinatorActor)
                    .options(**options)
                    .remote(cfg, None, ask_stale_snapshots=not replicated)
                )
            )
        shards.append(row)
    routers: list[ActorHandle[RouterActor]] = []
    for r in reversed(range(config.router_replicas)):  # replica 0 last: it holds the others
        options = {**common, "name": router_actor_name(config, r), **_placement(config, r)}
        # A call to a dead router fails at once (no retry wait), so its callers fail over to
        # another replica within milliseconds; workers resend their reports anyway.
        options["max_task_retries"] = 0
        peers = routers if r == 0 else []
        handle = handle_of(
            ray.remote(RouterActor).options(**options).remote(config, r, security, shards, peers)
        )
        routers.insert(0, handle)
    return routers
