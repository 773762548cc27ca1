"""The worker as a Ray actor: pool, KV store, model, gRPC page server, heartbeats.

`WorkerActor` is a plain class (tests can build one in-process); the client
wraps it with ``ray.remote`` and names it `worker_actor_name(worker_id)` in
the cluster namespace, so that a restarted coordinator finds it again. What
one actor owns::

    PagePool ─ KVCacheManager ─┐
    KVStore ───────────────────┼─ ServingEngine (TinyTransformer)   generate / prefill
    PageService (shared lock) ─┴─ ServerThread (grpc.aio, 127.0.0.1:free port)
                                  PeerClients (pull from / push to other workers)
                                  dist links (transport="dist": torch.distributed)
    heartbeat thread ── report(worker_id, [event batches], load) ──► coordinator actor

Events. Every change of the pool's cached set is drained into a batch
(`kvmesh.events.encode_batch`: worker id, a fresh incarnation uuid per
start, seq 0, 1, 2, ... from one counter) and reported every heartbeat
interval and right after each request, so the index is fresh for the next
route. A batch stays queued until the coordinator has acknowledged it (a
report that failed is resent; duplicates are ignored there). When the
coordinator says the worker is stale or unknown, the next report carries a
snapshot batch (the whole cached set) instead; `snapshot` serves the same
batch to a restarting coordinator. Every batch, snapshot or not, takes the
next seq, under one lock, so the coordinator sees one ordered stream.

Transports. With ``TransferConfig.transport="grpc"`` (default) pulls and
pushes go over the peers' gRPC servers. With ``"dist"`` they go over a
torch.distributed link per peer: the first use asks the coordinator
(``dist_link``), which hands out the rendezvous (its store, ranks, a fresh
prefix) and has the peer join through `dist_accept` (a thread that serves
the link until hang-up); pages arrive checked and cached in place. Any link
failure falls back to gRPC for that transfer, logged with its reason, and
the next transfer opens a fresh link. `stats` counts each transport.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvmesh.config import ClusterConfig
from kvmesh.errors import (
    ConfigError,
    InvalidInput,
    InvariantViolation,
    KVMeshError,
    PermissionDenied,
    RequestCancelled,
    TransportError,
    UnknownWorker,
)
from kvmesh.events import encode_batch, make_batch
from kvmesh.hashing import ExtraKeys, PageHasher
from kvmesh.load import WorkerLoad
from kvmesh.security import check_bind_address
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.cancellation import (
    CallerWatch,
    StopSignals,
    cancelled_count,
    count_cancelled,
    current_task_cancelled,
    ray_job_is_dead,
    request_deadline,
)

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")

WORKER_ACTOR_PREFIX = "kvmesh-worker-"


def worker_actor_name(worker_id: str) -> str:
    """The Ray actor name of a worker (in the cluster's namespace)."""
    return WORKER_ACTOR_PREFIX + worker_id


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker actor is built from: its id, role and the cluster config."""

    worker_id: WorkerId
    config: ClusterConfig = field(default_factory=ClusterConfig)
    role: Role = "both"
    torch_threads: int = 1
    max_concurrent: int = 1  # requests computing at once; the others queue
    page_delay_s: float = 0.0  # test hook: slow down every page this worker streams out

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise InvalidInput(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        if self.role not in ROLES:
            raise InvalidInput(f"role must be one of {ROLES}, got {self.role!r}")
        if self.torch_threads < 1 or self.max_concurrent < 1:
            raise InvalidInput("torch_threads and max_concurrent must be >= 1")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One request as a worker receives it: tokens, answer length, tenant keys, route promise.

    `promised_local` / `promised_pull` are what the route decision promised
    (already clamped to what a worker can reuse: never the prompt's last
    token); `peer_address` is the gRPC address of the worker holding the
    pullable pages, None for no pull.

    `timeout_s`: how long the caller waits for the answer; the worker stops the
    request that long after it arrives (a remaining budget, not a time of day,
    so that clocks of different nodes need not agree). `caller_job`: the
    caller's Ray job id (hex), so that the worker stops the request when the
    caller's process is gone. None: no limit / not watched.
    """

    request_id: str
    token_ids: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    lora_id: int | None = None
    promised_local: int = 0
    promised_pull: int = 0
    peer_address: str | None = None
    timeout_s: float | None = None
    caller_job: str | None = None

    @property
    def extra_keys(self) -> ExtraKeys:
        return ExtraKeys(lora_id=self.lora_id, cache_salt=self.cache_salt)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill worker did for one request before handing it to a decode worker."""

    request_id: str
    worker_id: WorkerId
    pages_hit_local: int
    pages_pulled: int
    pages_computed: int
    pages_pushed: int
    prefill_ms: float
    push_ms: float
    push_error: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker's state and counters since it started."""

    worker_id: WorkerId
    role: str
    address: str
    incarnation: str
    num_pages: int
    pages_used: int
    pages_free: int
    cached_pages: int
    running: int
    waiting: int
    requests: int
    errors: int
    prompt_pages: int
    pages_hit_local: int
    pages_pulled: int
    pages_computed: int
    pages_pushed: int
    batches_sent: int
    snapshots_sent: int
    last_seq: int
    draining: bool
    pulls_grpc: int = 0  # pulls delivered over gRPC (a dist fallback counts here too)
    pulls_dist: int = 0  # pulls delivered over torch.distributed
    pushes_grpc: int = 0
    pushes_dist: int = 0
    dist_fallbacks: int = 0  # torch.distributed transfers that failed and went over gRPC
    links_opened: int = 0  # torch.distributed links this worker opened (client end)
    links_served: int = 0  # torch.distributed links peers opened to this worker
    requests_cancelled: int = 0  # stopped before answering: cancelled, deadline, caller gone

    @property
    def page_hit_ratio(self) -> float:
        """Prompt pages served from this worker's own cache / all its prompt pages."""
        return self.pages_hit_local / self.prompt_pages if self.prompt_pages else 0.0


def _check_transport(cfg: ClusterConfig) -> None:
    """Refuse a transport the actor cannot use, before anything starts."""
    from kvmesh.worker.dist_transfer import FETCHERS

    transport = cfg.transfer.transport
    if transport not in FETCHERS:
        raise ConfigError(f"unknown transport {transport!r}; choose one of {sorted(FETCHERS)}")
    if transport == "dist" and cfg.security.profile == "production":
        raise ConfigError(
            "transport='dist' moves pages over torch.distributed without TLS or tokens; the "
            "production profile needs transport='grpc'"
        )


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    errors: int = 0
    prompt_pages: int = 0
    pages_hit_local: int = 0
    pages_pulled: int = 0
    pages_computed: int = 0
    pages_pushed: int = 0
    batches_sent: int = 0
    snapshots_sent: int = 0
    pulls_grpc: int = 0
    pulls_dist: int = 0
    pushes_grpc: int = 0
    pushes_dist: int = 0
    dist_fallbacks: int = 0
    links_opened: int = 0
    links_served: int = 0


def _unwrap(exc: BaseException) -> BaseException:
    """The original exception of a Ray task error (Ray wraps remote exceptions)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class WorkerActor:
    """One kvmesh worker; see the module docstring. Create it through Ray (`ray.remote`).

    `coordinator` is the coordinator actor's handle (None: run without one,
    e.g. in a test); the worker registers with it before `__init__` returns.
    """

    def __init__(self, spec: WorkerSpec, coordinator: Any | None = None) -> None:
        import torch

        from kvmesh.worker.cache_manager import KVCacheManager
        from kvmesh.worker.kv_store import KVStore
        from kvmesh.worker.model import TinyTransformer
        from kvmesh.worker.page_pool import PagePool
        from kvmesh.worker.page_service import EvictionBudget, PageService, PushGrants
        from kvmesh.worker.serving import ServingEngine
        from kvmesh.worker.transfer_server import ServerThread

        cfg = spec.config
        _check_transport(cfg)
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
            medium=cfg.pool.medium,
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
        # Workers started by another driver never saw KVMesh.connect's profile check:
        # refuse a non-loopback bind here unless the operator asked for it.
        check_bind_address(
            cfg.transfer.host,
            cfg.security.allow_remote or cfg.security.profile == "production",
        )
        self._server = ServerThread(self.pages, cfg.transfer, page_delay_s=spec.page_delay_s)
        self._server.start()
        self.address = self._advertised_address(self._server.server.port)
        self._peers: dict[str, Any] = {}
        self._peers_lock = threading.Lock()
        self._dist = cfg.transfer.transport == "dist"
        self._links: dict[str, Any] = {}  # peer address -> DistPageTransport (this end: client)
        self._link_locks: dict[str, threading.Lock] = {}
        self._served_links: dict[str, Any] = {}  # rendezvous prefix -> DistGroup (this end serves)

        self._coordinator = coordinator
        self._flush_lock = threading.Lock()
        self._next_seq = 0
        self._unacked: list[bytes] = []
        self._needs_snapshot = True  # the first report carries the whole (empty) cached set
        self._counters = _Counters()
        self._counters_lock = threading.Lock()
        self._draining = False
        self._stop = threading.Event()
        self._callers = CallerWatch(ray_job_is_dead)
        self._heartbeat_s = cfg.coordinator.heartbeat_interval_s
        self._rpc_timeout_s = max(5.0, cfg.coordinator.heartbeat_timeout_s)
        if coordinator is not None:
            try:
                self._register()
            except BaseException:
                self._server.stop()  # do not leave a server thread behind a failed start
                raise
            self.flush()
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name=f"kvmesh-heartbeat-{self.worker_id}", daemon=True
        )
        self._thread.start()

    # ---------------------------------------------------------------- serving

    def generate(self, request: GenerateRequest) -> Any:
        """Serve one request and report the pool's events before answering.

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
        self._announce(request)
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
                )
            except RequestCancelled as exc:
                count_cancelled(self.worker_id, signals.reason(exc))
                raise
            except KVMeshError:
                self._bump("errors")
                raise
            finally:
                self._flush_quietly()
        with self._counters_lock:
            c = self._counters
            c.requests += 1
            c.pages_hit_local += result.pages_hit_local
            c.pages_pulled += result.pages_pulled
            c.pages_computed += result.pages_computed
            c.prompt_pages += result.pages_hit_local + result.pages_pulled + result.pages_computed
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
        hashes = self.hasher.hash_prompt(request.token_ids, request.extra_keys)
        pushed, push_error = 0, None
        try:
            pushed = self._push(push_to, hashes, ticket) if hashes else 0
        except KVMeshError as exc:
            push_error = f"{type(exc).__name__}: {exc}"
            log.warning("push to %s failed; the decode worker will compute: %s", push_to, exc)
        self._bump("pages_pushed", pushed)
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
        )

    def compute_from_scratch(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The reference answer: the whole prompt in one pass, no cache (for tests)."""
        return self.engine.compute_from_scratch(token_ids, max_tokens)

    # ---------------------------------------------------------------- transfer

    def _peer(self, address: str) -> Any:
        from kvmesh.worker.transfer_client import SyncPeerClient

        with self._peers_lock:
            client = self._peers.get(address)
            if client is None:
                client = self._peers[address] = SyncPeerClient(address, self.config.transfer)
            return client

    def _pull(self, ask: Any) -> Any:
        """The engine's `pull_fn`: the peer's pages for `ask`, checked, proven against the
        request being served and cached in the pool as they arrive (`PulledInPlace`).

        Over gRPC large pulls are read off the socket straight into reserved
        pages (`TransferConfig.grpc_zero_copy`), small ones through grpcio's
        reused channels. Over torch.distributed the pages land in place too,
        falling back to gRPC with a logged reason.
        """
        if self._dist:
            return self._pull_in_place(ask)
        from kvmesh.worker.serving import PulledInPlace

        client = self._peer(ask.peer)
        self._bump("pulls_grpc")
        try:
            client.pull_into(self.pages.receiving(ask.proofs(self.hasher.page_size)), list(ask.page_hashes))
        except KVMeshError as exc:  # the whole pages cached before it still count
            return PulledInPlace(tuple(ask.page_hashes), "grpc", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a transport bug must not fail the request: compute instead
            raise TransportError(f"pull from {ask.peer} failed: {exc}") from exc
        return PulledInPlace(tuple(ask.page_hashes), "grpc")

    def _push(self, address: str, hashes: Sequence[PageHash], ticket: bytes) -> int:
        """Push the cached prefix of `hashes` to the worker at `address` under its grant
        `ticket`; returns the pages it took. Raises `PermissionDenied` when it refused
        them (no live grant, or pages its request does not prove).

        Over torch.distributed when configured, falling back to gRPC (logged)
        when the link fails; the fallback presents the same one-use ticket, so
        it is refused when the link had already delivered the push's preamble.
        """
        from kvmesh.rendezvous import LINK_SERVER_RANK

        held = self.pages.prefix_length(hashes)
        if not held:
            return 0
        todo = list(hashes[:held])
        if self._dist:
            try:
                sent = self._link(address).push(LINK_SERVER_RANK, todo, ticket)
                self._bump("pushes_dist")
                if sent.refused:
                    raise PermissionDenied(
                        f"the worker at {address} refused {sent.refused} of "
                        f"{len(sent.sent)} pushed pages (no live grant, or pages its request "
                        "does not prove)"
                    )
                return sent.stored
            except TransportError as exc:
                self._drop_link(address)
                self._bump("dist_fallbacks")
                log.warning("dist push to %s failed, falling back to gRPC: %s", address, exc)
        self._peer(address).push_from(self.pages, todo, ticket)
        self._bump("pushes_grpc")
        return held

    def _pull_in_place(self, ask: Any) -> Any:
        from kvmesh.rendezvous import LINK_SERVER_RANK
        from kvmesh.worker.dist_transfer import fetch_with_fallback
        from kvmesh.worker.serving import PulledInPlace

        outcome = fetch_with_fallback(
            self.pages,
            ask.page_hashes,
            ask.proofs(self.hasher.page_size),
            transport="dist",
            dist=lambda: self._link(ask.peer),
            peer_rank=LINK_SERVER_RANK,
            grpc=self._peer(ask.peer),
        )
        if outcome.fallback_reason is not None:
            self._drop_link(ask.peer)
            self._bump("dist_fallbacks")
        self._bump(f"pulls_{outcome.transport}")
        return PulledInPlace(tuple(ask.page_hashes), outcome.transport)

    # ---------------------------------------------------------------- torch.distributed links

    def _link(self, address: str) -> Any:
        """The link to the worker at `address` (this end rank 0), opened through the coordinator.

        Raises `TransportError` when it cannot be opened (no coordinator, the
        peer unknown or refusing, the rendezvous timing out).
        """
        with self._peers_lock:
            lock = self._link_locks.setdefault(address, threading.Lock())
        with lock:
            link = self._links.get(address)
            if link is not None and link.group.usable:
                return link
            self._drop_link(address)
            if self._coordinator is None:
                raise TransportError("no coordinator to open a torch.distributed link through")
            try:
                rdv = self._rpc("dist_link", self.worker_id, address)
            except Exception as exc:
                cause = _unwrap(exc)
                raise TransportError(
                    f"the coordinator could not open a link to {address}: "
                    f"{type(cause).__name__}: {cause}"
                ) from exc
            link = self._join_link(rdv)
            self._links[address] = link
            self._bump("links_opened")
            return link

    def _join_link(self, rendezvous: Any) -> Any:
        """Join a link's group (within the connect timeout) and wrap it in a transport whose
        transfers wait up to `dist_timeout_s`. Raises `TransportError`."""
        from kvmesh.worker.dist_transfer import DistGroup, DistPageTransport

        cfg = self.config.transfer
        group = DistGroup.join(
            rendezvous,
            self.worker_id,
            device=self.store.device,
            timeout_s=cfg.dist_connect_timeout_s,
            host=self._bind_host(),
        )
        group.timeout_s = cfg.dist_timeout_s
        return DistPageTransport.from_config(group, self.pages, cfg)

    def _drop_link(self, address: str) -> None:
        """Forget the link to `address` (closed; the next use opens a fresh one)."""
        link = self._links.pop(address, None)
        if link is not None:
            link.group.close()

    def dist_accept(self, rendezvous: Any) -> bool:
        """Join a link a peer opened through the coordinator and serve it in a thread.

        Returns at once (the peer joins meanwhile). Raises `ConfigError` when
        this worker does not take torch.distributed links, `UnknownWorker` /
        `InvalidInput` for a rendezvous that does not make it the serving rank.
        """
        from kvmesh.rendezvous import LINK_SERVER_RANK

        if not self._dist:
            raise ConfigError(
                f"worker {self.worker_id!r} moves pages over gRPC only; start it with "
                "TransferConfig.transport='dist' to take torch.distributed links"
            )
        if rendezvous.rank_of(self.worker_id) != LINK_SERVER_RANK:
            raise InvalidInput(f"worker {self.worker_id!r} is not the serving rank of this link")
        threading.Thread(
            target=self._serve_link,
            args=(rendezvous,),
            name=f"kvmesh-link-{self.worker_id}",
            daemon=True,
        ).start()
        return True

    def _serve_link(self, rendezvous: Any) -> None:
        """Join `rendezvous` as its serving rank and answer pulls/pushes until hang-up or failure."""
        from kvmesh.rendezvous import LINK_CLIENT_RANK

        client = rendezvous.worker_of(LINK_CLIENT_RANK)
        try:
            transport = self._join_link(rendezvous)
        except TransportError as exc:
            log.warning("link from %s was not joined: %s", client, exc)
            return
        group = transport.group
        self._served_links[rendezvous.prefix] = group
        self._bump("links_served")
        try:
            idle = self.config.transfer.dist_idle_timeout_s
            transport.serve_forever(LINK_CLIENT_RANK, idle_timeout_s=idle)
        except KVMeshError as exc:
            log.info("link from %s ended: %s", client, exc)
        finally:
            self._served_links.pop(rendezvous.prefix, None)
            group.close()

    # ---------------------------------------------------------------- events

    def _load(self, extra_prefill_tokens: int = 0) -> WorkerLoad:
        load = self.engine.load()
        return WorkerLoad(
            self.worker_id,
            active_prefill_tokens=load.prefill_tokens + extra_prefill_tokens,
            active_decode_pages=max(0, load.num_pages - 1 - load.free_pages),
            free_pages=load.free_pages,
            total_pages=load.num_pages - 1,
            draining=self._draining,
            active_requests=load.running + load.waiting + (extra_prefill_tokens > 0),
        )

    def _announce(self, request: GenerateRequest) -> None:
        """Tell the coordinator, without waiting, the load this request adds.

        Routing weighs queued prefill work; without this the coordinator would
        learn of a long prefill only at the next heartbeat, after it ended.
        """
        if self._coordinator is None:
            return
        reuse = (request.promised_local + request.promised_pull) * self.hasher.page_size
        try:
            load = self._load(max(0, len(request.token_ids) - reuse))
            self._rpc("heartbeat", self.worker_id, load, wait=False)
        except Exception as exc:  # an announcement is best effort
            log.warning("load announcement failed: %s", _unwrap(exc))

    def _batch(self, snapshot: bool) -> bytes | None:
        """Drain events into the next batch; a snapshot batch carries the whole cached set.

        None (and no seq used) when there is no event and no snapshot is asked for.
        Call with `_flush_lock` held: seqs are handed out in order under it.
        """
        with self._lock:
            events = self.pool.take_events()
            snap = self.pool.snapshot_events() if snapshot else []
        self.pages.observe(events)
        if not snapshot and not events:
            return None
        batch = make_batch(
            snap if snapshot else events,
            self.worker_id,
            self.incarnation,
            self._next_seq,
            snapshot=snapshot,
        )
        self._next_seq += 1
        return encode_batch(batch)

    def snapshot(self) -> bytes:
        """A snapshot batch of the whole cached set, taking the next seq (for a coordinator rebuild).

        Queued batches are dropped: their effects are in the snapshot.
        """
        with self._flush_lock:
            self._unacked.clear()
            self._bump("snapshots_sent")
            data = self._batch(snapshot=True)
            if data is None:  # pragma: no cover - a snapshot batch is always built
                raise InvariantViolation("snapshot batch was not built")
            return data

    def flush(self) -> bool:
        """Report queued events and the load to the coordinator now; True when acknowledged.

        Raises nothing when the coordinator is away: the batches stay queued and
        go out (again) with the next report; the coordinator ignores duplicates.
        """
        if self._coordinator is None:
            self.pages.take_events()
            return False
        with self._flush_lock:
            if self._needs_snapshot:
                self._unacked.clear()  # the snapshot covers them
                data = self._batch(snapshot=True)
                self._bump("snapshots_sent")
                self._needs_snapshot = False
            else:
                data = self._batch(snapshot=False)
            if data is not None:
                self._unacked.append(data)
            batches = list(self._unacked)
            try:
                reply = self._rpc("report", self.worker_id, batches, self._load())
            except Exception as exc:
                cause = _unwrap(exc)
                if isinstance(cause, UnknownWorker):  # expired, or the coordinator lost us
                    self._needs_snapshot = True
                    try:
                        self._register()
                    except Exception as again:
                        log.warning("re-registering failed (will retry): %s", _unwrap(again))
                else:
                    log.warning("report to the coordinator failed (will resend): %s", cause)
                return False
            self._unacked.clear()
            self._bump("batches_sent", len(batches))
            if reply.needs_snapshot:
                self._needs_snapshot = True
            return True

    def _bump(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            setattr(self._counters, name, getattr(self._counters, name) + n)

    def _flush_quietly(self) -> None:
        try:
            self.flush()
        except Exception:  # reporting must never fail a request
            log.exception("flushing events failed")

    def _rpc(self, method: str, *args: Any, wait: bool = True, **kwargs: Any) -> Any:
        """Call the coordinator: a Ray actor handle (awaited up to the RPC timeout unless
        not `wait`) or, in one process (tests, tools), a plain `Coordinator`."""
        fn = getattr(self._coordinator, method)
        remote = getattr(fn, "remote", None)
        if remote is None:
            return fn(*args, **kwargs)
        ref = remote(*args, **kwargs)
        if not wait:
            return None
        import ray

        return ray.get(ref, timeout=self._rpc_timeout_s)

    def _register(self) -> None:
        if self._coordinator is None:
            return
        self._rpc(
            "register_worker",
            self.worker_id,
            self.address,
            self.pool.num_pages - 1,
            self.incarnation,
            self.role,
            actor_name=worker_actor_name(self.worker_id),
            actor_namespace=self.config.coordinator.namespace,
        )
        self._needs_snapshot = True

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            self._flush_quietly()

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
        with self._counters_lock:
            c = dataclasses.replace(self._counters)
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
            requests=c.requests,
            errors=c.errors,
            prompt_pages=c.prompt_pages,
            pages_hit_local=c.pages_hit_local,
            pages_pulled=c.pages_pulled,
            pages_computed=c.pages_computed,
            pages_pushed=c.pages_pushed,
            batches_sent=c.batches_sent,
            snapshots_sent=c.snapshots_sent,
            last_seq=self._next_seq - 1,
            draining=self._draining,
            pulls_grpc=c.pulls_grpc,
            pulls_dist=c.pulls_dist,
            pushes_grpc=c.pushes_grpc,
            pushes_dist=c.pushes_dist,
            dist_fallbacks=c.dist_fallbacks,
            links_opened=c.links_opened,
            links_served=c.links_served,
            requests_cancelled=cancelled_count(self.worker_id),
        )

    def reset_cache(self) -> None:
        """Forget every cached page (an `AllPagesCleared` event) and report it.

        Raises `PagesInUse` while requests hold pages.
        """
        with self._lock:
            self.cache_manager.reset_prefix_cache()
        with self._counters_lock:
            self._counters = _Counters(
                batches_sent=self._counters.batches_sent,
                snapshots_sent=self._counters.snapshots_sent,
            )
        self.flush()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop taking new requests: NOT_SERVING on gRPC health, draining at the coordinator.

        Waits up to `timeout_s` for running requests; True when none is left.
        """
        self._draining = True
        self._server.set_serving(False)
        if self._coordinator is not None:
            try:
                self._rpc("drain_worker", self.worker_id, True)
            except Exception as exc:
                log.warning("could not tell the coordinator about draining: %s", _unwrap(exc))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            load = self.engine.load()
            if load.running + load.waiting == 0:
                return True
            time.sleep(0.02)
        return False

    def shutdown(self) -> None:
        """Stop heartbeats and the gRPC server (the actor can then be killed)."""
        self._stop.set()
        self._callers.close()
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            close: Callable[[], None] | None = getattr(p, "close", None)
            if close is not None:
                close()
        self._hang_up_links()
        self._server.stop()

    def _hang_up_links(self) -> None:
        """Tell every peer this worker opened a link to that it ends (best effort), close them."""
        from kvmesh.rendezvous import LINK_SERVER_RANK

        for address in list(self._links):
            link = self._links.get(address)
            if link is not None and link.group.usable:
                try:
                    link.hang_up(LINK_SERVER_RANK)
                except KVMeshError as exc:
                    log.info("hang-up on the link to %s failed: %s", address, exc)
            self._drop_link(address)

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


__all__ = [
    "ROLES",
    "GenerateRequest",
    "PrefillResult",
    "Role",
    "WorkerActor",
    "WorkerSpec",
    "WorkerStats",
    "worker_actor_name",
]
