"""The worker as a Ray actor: pool, KV store, model, gRPC page server, heartbeats.

`WorkerActor` is a plain class (tests can build one in-process); the client
wraps it with ``ray.remote`` and names it `worker_actor_name(worker_id)` in
the cluster namespace, so that a restarted coordinator finds it again. What
one actor owns::

    PagePool ─ KVCacheManager ─┐
    KVStore ───────────────────┼─ ServingEngine (TinyTransformer)   generate / prefill
    PageService (shared lock) ─┴─ ServerThread (grpc.aio, 127.0.0.1:free port)
                                  Peers (pull from / push to other workers: gRPC or
                                  torch.distributed links, DistLinks)
    EventReporter thread ── report(worker_id, [event batches], load) ──► coordinator actor

Events go to the coordinator through an `EventReporter`
(`kvmesh.worker.events_reporter`: ordered, acknowledged batches, snapshots
when the coordinator asks), every heartbeat interval and right after each
request, so the index is fresh for the next route.

Peers. Pulls and pushes go through `Peers` (`kvmesh.worker.peers`): the
peer at an address, reached over ``TransferConfig.transport`` ("grpc", the
default, or "dist": a torch.distributed link per peer, `DistLinks`, falling
back to gRPC with a logged reason). Every page enters the pool through the
`PageService`, proven against the request it serves. `stats` counts each
transport.

Requests. `generate` serves one request (local hits, pulls from the peer
the route decision named, computes the rest, decodes); `prefill` is the
prefill half of disaggregation: compute the prompt's pages and push them to
the decode worker, which then serves the request from them. Requests run on
Ray's thread pool (``max_concurrency``); the engine lets one compute at a
time and the rest wait (their queue time), so `stats`, `ping` and
`snapshot` never wait behind a long prefill.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmesh.coordination import WorkerRegistration
from kvmesh.errors import InvalidInput, KVMeshError, RequestCancelled, TransportError
from kvmesh.handles import WorkerCoordinator
from kvmesh.hashing import PageHasher, RequestHashes
from kvmesh.load import WorkerLoad
from kvmesh.logs import configure_logging, request_scope
from kvmesh.metrics import (
    PAGES_PUSHED,
    POOL_PAGES,
    PROMPT_PAGES,
    TIER_EVICTIONS,
    TRANSFER_BYTES,
    TRANSFER_SECONDS,
    WORKER_ERRORS,
    WORKER_REQUESTS,
    in_ray_actor,
)
from kvmesh.rendezvous import DistRendezvous
from kvmesh.requests import (
    GenerateRequest,
    GenerationResult,
    PrefillResult,
    ReportMark,
    Role,
    RouteOutcome,
    WorkerSpec,
    WorkerStats,
)
from kvmesh.security import check_bind_address
from kvmesh.types import PageHash, PageId, WorkerId
from kvmesh.worker.cancellation import (
    CallerWatch,
    StopSignals,
    cancelled_count,
    count_cancelled,
    current_task_cancelled,
    ray_job_is_dead,
    request_deadline,
)
from kvmesh.worker.events_reporter import remote_cause

if TYPE_CHECKING:
    from kvmesh.worker.page_pool import PageMeta
    from kvmesh.worker.page_service import PullOutcome
    from kvmesh.worker.serving import PullRequest

log = logging.getLogger(__name__)

WORKER_ACTOR_PREFIX = "kvmesh-worker-"


def worker_actor_name(worker_id: str) -> str:
    """The Ray actor name of a worker (in the cluster's namespace)."""
    return WORKER_ACTOR_PREFIX + worker_id


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """What a worker's requests came to, read back from its metrics (`kvmesh.metrics`)."""

    requests: int = 0
    errors: int = 0
    prompt_pages: int = 0
    pages_hit_local: int = 0
    pages_pulled: int = 0
    pages_computed: int = 0
    pages_pushed: int = 0

    @classmethod
    def read(cls, worker: str) -> RequestCounts:
        """This process's totals for `worker` (since the process started)."""

        def pages(source: str) -> int:
            return int(PROMPT_PAGES.value(worker=worker, source=source))

        local, pulled, computed = pages("local"), pages("pulled"), pages("computed")
        return cls(
            int(WORKER_REQUESTS.value(worker=worker)),
            int(WORKER_ERRORS.value(worker=worker)),
            local + pulled + computed,
            local,
            pulled,
            computed,
            int(PAGES_PUSHED.value(worker=worker)),
        )

    def since(self, base: RequestCounts) -> RequestCounts:
        return RequestCounts(
            *(getattr(self, f.name) - getattr(base, f.name) for f in dataclasses.fields(self))
        )


class WorkerActor:
    """One kvmesh worker; see the module docstring. Create it through Ray (`ray.remote`).

    `coordinator` is the coordinator actor's handle (None: run without one,
    e.g. in a test); the worker registers with it before `__init__` returns.
    """

    def __init__(self, spec: WorkerSpec, coordinator: WorkerCoordinator | None = None) -> None:
        import torch

        from kvmesh.worker.cache_manager import KVCacheManager
        from kvmesh.worker.devices import resolve_device
        from kvmesh.worker.events_reporter import CoordinatorRpc, EventReporter
        from kvmesh.worker.kv_store import KVStore
        from kvmesh.worker.links import DistLinks
        from kvmesh.worker.model import TinyTransformer
        from kvmesh.worker.page_pool import PagePool
        from kvmesh.worker.page_service import EvictionBudget, PageService, PushGrants
        from kvmesh.worker.peers import Peers, check_transport
        from kvmesh.worker.serving import ServingEngine
        from kvmesh.worker.tiered_cache import TieredCache
        from kvmesh.worker.transfer_server import ServerThread

        cfg = spec.config
        if in_ray_actor():  # this process is the actor's own: log as kvmesh does
            configure_logging()
        check_transport(cfg.transfer.transport, cfg.security.profile)
        # The device is this node's to decide ("auto"); model, store and links follow it.
        device = resolve_device(cfg.model.device)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device=str(device)))
        medium = cfg.pool.medium  # the index's device tier whatever the torch device: a CPU
        # worker's own pages are device hits, never host-tier ones charged a promotion
        torch.set_num_threads(spec.torch_threads)
        page_size = cfg.hash.page_size
        self.spec = spec
        self.config = cfg
        self.worker_id = spec.worker_id
        self.role: Role = spec.role
        self.incarnation = uuid.uuid4().hex
        self.hasher = PageHasher.from_config(cfg.hash)
        self._lock = threading.RLock()  # the pool's lock: engine, page service, events
        pool = PagePool(
            cfg.pool.num_pages,
            enable_caching=cfg.pool.enable_caching,
            medium=medium,
            page_size=page_size,
        )
        self.pool = pool
        self.cache_manager = KVCacheManager(pool, page_size, enable_caching=cfg.pool.enable_caching)
        self.store = KVStore.from_config(cfg.model, cfg.pool, page_size)
        self.pages = PageService(
            pool,
            self.store,
            self.hasher,
            lock=self._lock,
            grants=PushGrants(cfg.transfer.push_grant_ttl_s),
            evictions=EvictionBudget(
                int(cfg.pool.num_pages * cfg.transfer.push_evict_fraction),
                cfg.transfer.push_evict_window_s,
            ),
            name=self.worker_id,
        )
        # host and disk tiers under the pool, if configured (lookups and pulls promote)
        self.tiers = TieredCache.for_worker(
            cfg, self.cache_manager, self.store, self.pages, self.worker_id
        )
        if self.tiers is None:  # no tier below counts the pool's evictions: count them here
            pool.spill_listener = self._count_evictions
        self.model = TinyTransformer(cfg.model)
        # Warm the kernels (and the allocator, at a full chunk) before anything is timed.
        warm = min(cfg.model.prefill_chunk_tokens, cfg.model.max_positions - 2)
        self.model.generate([1] * max(warm, 2), 2)
        self.engine = ServingEngine(
            self.model,
            self.cache_manager,
            self.store,
            self.hasher,
            worker_id=self.worker_id,
            max_concurrent=spec.max_concurrent,
            lock=self._lock,
        )
        # Workers started by another driver never saw kvmesh.app.connect's profile check:
        # refuse a non-loopback bind here unless the operator asked for it.
        check_bind_address(
            cfg.transfer.host,
            cfg.security.allow_remote or cfg.security.profile == "production",
        )
        self._server = ServerThread(self.pages, cfg.transfer, page_delay_s=spec.page_delay_s)
        self._server.start()
        self.address = self._advertised_address(self._server.server.port)

        rpc_timeout_s = max(5.0, cfg.coordinator.heartbeat_timeout_s)
        self._rpc = None if coordinator is None else CoordinatorRpc(coordinator, rpc_timeout_s)
        self.links = DistLinks(
            self.worker_id,
            self.pages,
            cfg.transfer,
            open_rendezvous=self._open_link if self._rpc is not None else None,
            host=self._bind_host(),
        )
        self.peers = Peers(cfg.transfer, links=self.links, worker=self.worker_id)
        # the metrics count since the process started; stats count since start or reset_cache
        self._counts_base = RequestCounts.read(self.worker_id)
        self._pages_metrics = {
            state: POOL_PAGES.labels(self.worker_id, medium, state)
            for state in ("used", "free", "cached")
        }
        self._draining = False
        self._callers = CallerWatch(ray_job_is_dead)
        self.reporter = EventReporter(
            self.worker_id,
            self.incarnation,
            self.pages,
            rpc=self._rpc,
            register=self._register,
            load=self._load,
            interval_s=cfg.coordinator.heartbeat_interval_s,
        )
        if self._rpc is not None:
            try:
                self.reporter.register()
            except BaseException:
                self._server.stop()  # do not leave a server thread behind a failed start
                raise
            self.reporter.flush()
        self.reporter.start()

    # ---------------------------------------------------------------- serving

    def generate(self, request: GenerateRequest) -> GenerationResult:
        """`_generate` in the request's scope: its id on this worker's log records and on
        the `KVMeshError` it raises (`kvmesh.logs.request_scope`)."""
        with request_scope(request.request_id):
            return self._generate(request)

    def _generate(self, request: GenerateRequest) -> GenerationResult:
        """Serve one request; its report (events, load, route outcome) is sent before the
        answer and never waited for (`EventReporter.report_request`).

        Returns the engine's `GenerationResult`. Raises the engine's
        `KVMeshError`s (bad input, full pool); a failed pull is not an error
        (its pages are computed, `pull_error` says why). Raises `RequestCancelled`
        (counted in `kvmesh_requests_cancelled_total`) when the caller cancelled
        this task (`ray.cancel`), its process is gone, or `timeout_s` passed
        (`RequestExpired`); see `kvmesh.worker.cancellation`.
        """
        from kvmesh.worker.serving import RouteHint

        deadline = request_deadline(request.timeout_s, request.caller_job, self.engine.clock)
        hint = RouteHint(request.promised_local, request.promised_pull, request.peer_address)
        pull = self._pull if request.peer_address else None
        outcome: RouteOutcome | None = None
        with contextlib.ExitStack() as scope:
            caller_gone = None
            if request.caller_job is not None:
                caller_gone = scope.enter_context(self._callers.watch(request.caller_job))
            signals = StopSignals(current_task_cancelled(), caller_gone)
            try:
                result = self.engine.serve(
                    request.request_id,
                    request.token_ids,
                    request.max_tokens,
                    extra_keys=request.extra_keys,
                    hint=hint,
                    pull_fn=pull,
                    cancelled=signals.cancelled,
                    deadline=deadline,
                    page_hashes=request.page_hashes,
                )
                outcome = RouteOutcome(
                    request.promised_local,
                    request.promised_pull,
                    result.pages_hit_local,
                    result.pages_pulled,
                )
            except RequestCancelled as exc:
                count_cancelled(self.worker_id, signals.reason(exc))
                raise
            except KVMeshError as exc:
                WORKER_ERRORS.labels(self.worker_id, type(exc).__name__).inc()
                raise
            finally:
                self.reporter.report_request(outcome)
        if self._rpc is not None and self.reporter.last_seq >= 0:  # the client's next route
            mark = ReportMark(self.worker_id, self.incarnation, self.reporter.last_seq)
            result = dataclasses.replace(result, reported=mark)
        wid = self.worker_id
        WORKER_REQUESTS.labels(wid).inc()
        PROMPT_PAGES.labels(wid, "local").inc(result.pages_hit_local)
        PROMPT_PAGES.labels(wid, "pulled").inc(result.pages_pulled)
        PROMPT_PAGES.labels(wid, "computed").inc(result.pages_computed)
        return result

    def expect_push(self, request: GenerateRequest) -> bytes:
        """Disaggregation, decode side: grant a push of `request`'s pages; returns the ticket.

        The grant holds this worker's own proofs of the prompt's full pages
        (its tokens, salt, LoRA), so only those pages, proven, can be pushed
        under it, once, within `TransferConfig.push_grant_ttl_s`. The ticket
        goes to the prefill worker (`prefill`) through the trusted client.
        """
        from kvmesh.worker.page_service import ProofBook

        tokens, keys = request.token_ids, request.extra_keys
        return self.pages.grants.grant(ProofBook.for_prompt(self.hasher, tokens, keys))

    def prefill(self, request: GenerateRequest, push_to: str, ticket: bytes) -> PrefillResult:
        """Disaggregation, prefill side: compute the prompt's pages, push them to `push_to`
        under the grant `ticket` that worker handed out (`expect_push`).

        Pushes every full page of the prompt (the decode worker skips those it
        already holds). A failed push is not an error: `push_error` says why and
        `pages_pushed` is 0, and the decode worker computes what it lacks.
        """
        if not push_to:
            raise InvalidInput("prefill needs the decode worker's address to push to")
        t0 = time.perf_counter()
        # the same request (its deadline and caller included), without an answer
        prefill_only = dataclasses.replace(request, max_tokens=0)
        result = self.generate(prefill_only)
        t1 = time.perf_counter()
        tokens, keys = request.token_ids, request.extra_keys
        given = RequestHashes.given(self.hasher, tokens, keys, request.page_hashes)
        hashes = given.hashes if given is not None else self.hasher.hash_prompt(tokens, keys)
        pushed, push_error = 0, None
        try:
            pushed = self._push(push_to, hashes, ticket) if hashes else 0
        except KVMeshError as exc:
            push_error = f"{type(exc).__name__}: {exc}"
            log.warning("push to %s failed; the decode worker will compute: %s", push_to, exc)
        PAGES_PUSHED.labels(self.worker_id).inc(pushed)
        return PrefillResult(
            request.request_id,
            self.worker_id,
            result.pages_hit_local,
            result.pages_pulled,
            result.pages_computed,
            pushed,
            (t1 - t0) * 1e3,
            (time.perf_counter() - t1) * 1e3,
            push_error,
            result.reported,
        )

    def compute_from_scratch(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The reference answer: the whole prompt in one pass, no cache (for tests)."""
        return self.engine.compute_from_scratch(token_ids, max_tokens)

    # ---------------------------------------------------------------- transfer

    def _pull(self, ask: PullRequest) -> PullOutcome:
        """The engine's `pull_fn`: the peer's pages for `ask`, each checked and proven
        against the request being served as it enters the pool."""
        receiver = self.pages.receiving(ask.proofs(self.hasher.page_size))
        t0 = time.perf_counter()
        outcome = self.peers.get(ask.peer).pull_into(receiver, ask.page_hashes)
        self._count_transfer("pull", outcome.transport, outcome.inserted, t0)
        return outcome

    def _push(self, address: str, hashes: Sequence[PageHash], ticket: bytes) -> int:
        """Push the cached prefix of `hashes` to the worker at `address` under its grant
        `ticket`; returns the pages it holds now. Raises `PermissionDenied` when it refused
        them (no live grant, or pages its request does not prove)."""
        held = self.pages.prefix_length(hashes)
        if not held:
            return 0
        t0 = time.perf_counter()
        outcome = self.peers.get(address).push(self.pages, hashes[:held], ticket)
        self._count_transfer("push", outcome.transport, outcome.sent, t0)
        return outcome.stored

    def _count_evictions(self, evicted: list[tuple[PageId, PageMeta]]) -> None:
        """The pool's `spill_listener` without tiers: evicted pages per tenant, one add each."""
        for tenant, n in Counter(meta.tenant for _, meta in evicted).items():
            TIER_EVICTIONS.labels(self.worker_id, self.pool.medium, tenant).inc(n)

    def _count_transfer(self, direction: str, transport: str, pages: int, t0: float) -> None:
        TRANSFER_SECONDS.labels(self.worker_id, direction, transport).observe(
            time.perf_counter() - t0
        )
        TRANSFER_BYTES.labels(self.worker_id, direction, transport).inc(
            pages * self.store.page_nbytes
        )

    def _open_link(self, address: str) -> DistRendezvous:
        """The coordinator's rendezvous for a link from this worker to `address`."""
        if self._rpc is None:  # pragma: no cover - links get no opener without one
            raise TransportError("no coordinator to open a torch.distributed link through")
        return self._rpc("dist_link", self.worker_id, address)

    def dist_accept(self, rendezvous: DistRendezvous) -> bool:
        """Join a link a peer opened through the coordinator and serve it in a thread
        (`DistLinks.accept`, which says what it refuses); returns at once."""
        self.links.accept(rendezvous)
        return True

    # ---------------------------------------------------------------- events

    def _load(self, extra_prefill_tokens: int = 0) -> WorkerLoad:
        """The load to report (every heartbeat and request), which also refreshes the
        pool's page gauges."""
        load = self.engine.load()
        used = max(0, load.num_pages - 1 - load.free_pages)
        self._pages_metrics["used"].set(used)
        self._pages_metrics["free"].set(load.free_pages)
        self._pages_metrics["cached"].set(self.pool.num_cached_hashes())
        return WorkerLoad(
            self.worker_id,
            active_prefill_tokens=load.prefill_tokens + extra_prefill_tokens,
            active_decode_pages=max(0, load.num_pages - 1 - load.free_pages),
            free_pages=load.free_pages,
            total_pages=load.num_pages - 1,
            draining=self._draining,
            active_requests=load.running + load.waiting + (extra_prefill_tokens > 0),
        )

    def snapshot(self) -> bytes:
        """A snapshot batch of the whole cached set, taking the next seq (for a coordinator
        rebuild); see `EventReporter.snapshot`."""
        return self.reporter.snapshot()

    def flush(self) -> bool:
        """Report queued events and the load to the coordinator now; True when acknowledged
        (see `EventReporter.flush`)."""
        return self.reporter.flush()

    def _register(self) -> None:
        if self._rpc is None:
            return
        self._rpc(
            "register_worker",
            WorkerRegistration(
                self.worker_id,
                self.address,
                self.pool.num_pages - 1,
                self.incarnation,
                self.role,
                actor_name=worker_actor_name(self.worker_id),
                actor_namespace=self.config.coordinator.namespace,
            ),
        )

    # ---------------------------------------------------------------- control

    def ping(self) -> WorkerId:
        """The worker's id (a liveness probe)."""
        return self.worker_id

    def info(self) -> dict[str, Any]:
        """Id, role, gRPC address, incarnation and process id."""
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "address": self.address,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
        }

    def stats(self) -> WorkerStats:
        load = self.engine.load()
        with self._lock:
            cached = len(self.pool.cached_hashes())
        requests = RequestCounts.read(self.worker_id).since(self._counts_base)
        return WorkerStats(
            worker_id=self.worker_id,
            role=self.role,
            address=self.address,
            incarnation=self.incarnation,
            num_pages=load.num_pages - 1,
            pages_used=max(0, load.num_pages - 1 - load.free_pages),
            pages_free=load.free_pages,
            cached_pages=cached,
            running=load.running,
            waiting=load.waiting,
            batches_sent=self.reporter.batches_sent,
            snapshots_sent=self.reporter.snapshots_sent,
            last_seq=self.reporter.last_seq,
            draining=self._draining,
            links_opened=self.links.opened,
            links_served=self.links.served,
            requests_cancelled=cancelled_count(self.worker_id),
            **dataclasses.asdict(requests),
            **dataclasses.asdict(self.peers.counts()),
        )

    def reset_cache(self) -> None:
        """Forget every cached page (an `AllPagesCleared` event) and report it.

        Raises `PagesInUse` while requests hold pages. Request and transfer
        counters restart; event batches keep counting.
        """
        with self._lock:
            self.cache_manager.reset_prefix_cache()
        self._counts_base = RequestCounts.read(self.worker_id)
        self.peers.reset_counts()
        self.links.reset_counts()
        self.flush()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop taking new requests: NOT_SERVING on gRPC health, draining at the coordinator.

        Waits up to `timeout_s` for running requests; True when none is left.
        """
        self._draining = True
        self._server.set_serving(False)
        if self._rpc is not None:
            try:
                self._rpc("drain_worker", self.worker_id, True)
            except Exception as exc:
                log.warning("could not tell the coordinator about draining: %s", remote_cause(exc))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            load = self.engine.load()
            if load.running + load.waiting == 0:
                return True
            time.sleep(0.02)
        return False

    def shutdown(self) -> None:
        """Stop heartbeats, peers, links and the gRPC server (the actor can then be killed)."""
        self.reporter.stop()
        self._callers.close()
        self.peers.close()
        self._server.stop()
        if self.tiers is not None:
            self.tiers.close()  # finish queued disk writes

    def check_invariants(self) -> None:
        """The pool's invariants (raises `InvariantViolation`)."""
        self.pages.check_invariants()

    def _bind_host(self) -> str:
        """The address peers reach this worker at: the configured host, or the node's IP
        when the server listens on every interface."""
        host = self.config.transfer.host
        if host in ("0.0.0.0", "::", ""):
            import ray

            host = ray.util.get_node_ip_address()
        return host

    def _advertised_address(self, port: int) -> str:
        host = self._bind_host()
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["WorkerActor", "worker_actor_name"]
