"""The trace simulator's engine: simulated workers replaying a trace under one routing policy.

Everything that decides what is cached and where a request goes is the real
code: each simulated worker runs a real `PagePool` under a real
`KVCacheManager`, its KV events flow as `EventBatch`es (per-worker sequence
numbers) into a real `GlobalIndex`, and a real policy from
`kvmesh.coordinator.policies.REGISTRY` routes every request on the index's
overlaps and the workers' loads. Only time is modelled (`TimeModel`)::

    arrival ─► route (index.match + policy.choose) ─► worker's prefill queue (FIFO)
    prefill start: local hit (get_computed_pages), [--pull: peer pages], allocate
    prefill end  = start + 5 ms + 80 us x computed tokens (+ 6.4 ms x pulled pages)
                   -> cache the prompt's full pages (events -> index), first token
    decode end   = prefill end + 25 ms x output tokens -> free pages tail-first

With host or disk pages (`SimSettings`), each pool has the worker's real
`TieredCache` under it: pages the pool evicts spill to host memory, then to
disk page files; at prefill start the pages below that extend the device's
prefix are promoted (2.6 ms a page from host, 12.8 ms from disk, added to the
prefill), and the index learns every move from the pool's events, so
`kv_aware` weighs each worker's hit by its tier (`GlobalIndex.tier_pages`).

A worker computes one prefill at a time; decode is batched, so it only holds
pages (load). TTFT = queue wait + prefill (+ pulls, promotions). A prefill that cannot get
its pages waits until a decode on its worker frees some.

The trace's block ids are pages (512 tokens): a block's tokens come from
`kvmesh.trace.block_tokens` and the page hashes from the real `PageHasher`,
computed once per distinct (parent, block) before the replay. A partial last
block is a page that is computed but never cached (only full pages are
hashed), and the page holding the last prompt token is never a hit (it is
recomputed for its logits). The pools' events leave out token ids: only the
index reads them, and it keys on hashes.
"""

from __future__ import annotations

import heapq
import math
import tempfile
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import cast

import torch

from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import RouteDecision, RouteRequest, RoutingPolicy, WorkerLoad
from kvmesh.coordinator.tenant_shares import TenantShares
from kvmesh.coordinator.tiers import TierCosts
from kvmesh.errors import ConfigError, InvalidInput, InvariantViolation
from kvmesh.events import ApplyResult, EventBatch
from kvmesh.hashing import PageHasher, RequestHashes, reusable_pages
from kvmesh.tenants import DEFAULT_TENANT, TenantWeights, tenant_of
from kvmesh.trace import TRACE_BLOCK_TOKENS, TraceRequest, block_tokens, infinite_cache_hit_ratio
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.cache_manager import KVCacheManager, Request
from kvmesh.worker.disk_tier import encode_page_file
from kvmesh.worker.free_queue import KVPage
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.page_pool import PageMeta, PagePool
from kvmesh.worker.tiered_cache import TieredCache, page_blob


@dataclass(frozen=True, slots=True)
class TimeModel:
    """The modelled costs (about one H100 serving an 8B model).

    A pulled page is 64 MB of KV moved at 10 GB/s: 6.4 ms, against 41 ms to
    compute its 512 tokens, so pulling normally wins. Promoting a page from
    the host tier copies it over PCIe (~25 GB/s: 2.6 ms), from the disk tier
    reads it from NVMe first (~5 GB/s: 12.8 ms); a promotion holds the
    prefill slot like a pull.
    """

    prefill_base_ms: float = 5.0
    prefill_token_us: float = 80.0
    decode_token_ms: float = 25.0
    pull_page_ms: float = 6.4
    host_page_ms: float = 2.6
    disk_page_ms: float = 12.8

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"time model {f.name} must be a finite number >= 0, got {value}")

    def prefill_ms(
        self, computed_tokens: int, pulled_pages: int = 0, promote_ms: float = 0.0
    ) -> float:
        """Prefill duration: fixed cost, computed tokens, pulled pages, promotions."""
        return (
            self.prefill_base_ms
            + computed_tokens * self.prefill_token_us / 1000.0
            + pulled_pages * self.pull_page_ms
            + promote_ms
        )

    def promote_ms(self, host_pages: int, disk_pages: int) -> float:
        """Time to bring pages up from the host and disk tiers into the device pool."""
        return host_pages * self.host_page_ms + disk_pages * self.disk_page_ms

    def work_tokens(
        self, computed_tokens: int, pulled_pages: int = 0, promote_ms: float = 0.0
    ) -> int:
        """A prefill's work as a worker reports it: computed tokens, plus the
        tokens its pull and promotion time would have computed (they hold the
        prefill slot too)."""
        extra_ms = pulled_pages * self.pull_page_ms + promote_ms
        if extra_ms <= 0 or self.prefill_token_us <= 0:
            return computed_tokens
        return computed_tokens + round(extra_ms * 1000.0 / self.prefill_token_us)

    def tier_costs(self, page_size: int) -> TierCosts:
        """What `kv_aware` should charge a host hit, a disk hit and a pull under this model."""
        return TierCosts.from_ms(
            max(page_size * self.prefill_token_us / 1000.0, 1e-9),
            self.host_page_ms,
            self.disk_page_ms,
            self.pull_page_ms,
        )

    def pull_pays(self, page_size: int) -> bool:
        """Whether pulling a full page is cheaper than computing it."""
        return self.pull_page_ms < page_size * self.prefill_token_us / 1000.0


@dataclass(frozen=True, slots=True)
class SimSettings:
    """The simulated cluster: workers, pages per worker (device, host, disk), pulls, costs.

    `host_pages` / `disk_pages` > 0 put the worker's real `TieredCache` under
    each device pool (the disk tier writes real page files, into a temporary
    folder removed after the run); `eviction` ("lru" or "fair") and
    `tenant_weights` are the tiers' and pools' eviction policy.
    """

    workers: int = 8
    capacity_pages: int = 10_000
    pull: bool = False
    time: TimeModel = field(default_factory=TimeModel)
    page_size: int = TRACE_BLOCK_TOKENS
    host_pages: int = 0
    disk_pages: int = 0
    eviction: str = "lru"
    tenant_weights: str = ""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers (--workers) must be at least 1, got {self.workers}")
        if self.capacity_pages < 1:
            raise ConfigError(
                f"capacity_pages (--capacity-pages) must be at least 1, got {self.capacity_pages}"
            )
        if self.host_pages < 0 or self.disk_pages < 0:
            raise ConfigError(
                f"host_pages and disk_pages (--host-pages, --disk-pages) must be >= 0, got "
                f"{self.host_pages} and {self.disk_pages}"
            )

    @property
    def tiered(self) -> bool:
        return self.host_pages > 0 or self.disk_pages > 0 or self.eviction != "lru"


# --------------------------------------------------------------------- the trace


QUIET_TENANT = tenant_of("quiet")
"""The trace's own tenant when a flooding neighbour shares the cluster (`with_flood`)."""
FLOOD_TENANT = tenant_of("flood")
"""The neighbour sending unique prompts."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One trace request ready to replay.

    `num_pages` counts every prompt block (a partial last one too);
    `page_hashes` are the chained hashes of the full pages only, as
    `RequestHashes` would compute them.
    """

    request_id: str
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    page_hashes: tuple[PageHash, ...]
    tenant: str = DEFAULT_TENANT

    @property
    def num_pages(self) -> int:
        return len(self.block_ids)


class PreparedTrace:
    """A trace with its page hashes computed, and the tokens of its blocks.

    This is the slow part of a run (the bundled trace: 182,790 distinct
    blocks, ~0.07 ms of `block_tokens` and ~0.01 ms of hashing each), so it
    happens once and every policy replays the same prepared trace. A block's
    tokens are kept as a packed uint32 array (2 KiB per distinct block) to
    rebuild a prompt's token ids.
    """

    __slots__ = ("_tokens", "bound_hit_ratio", "hasher", "requests")

    def __init__(self, trace: Sequence[TraceRequest], hasher: PageHasher) -> None:
        size = hasher.page_size
        memo: dict[tuple[PageHash | None, int], PageHash] = {}
        tokens: dict[int, array[int]] = {}
        out: list[SimRequest] = []
        for i, req in enumerate(trace):
            n = len(req.hash_ids)
            if n != -(-req.input_length // size):
                raise InvalidInput(
                    f"trace request {i}: {req.input_length} input tokens need "
                    f"{-(-req.input_length // size)} blocks of {size}, got {n} hash_ids"
                )
            full = req.input_length // size
            hashes: list[PageHash] = []
            parent: PageHash | None = None
            for j, block in enumerate(req.hash_ids):
                toks = tokens.get(block)
                if toks is None:
                    toks = tokens[block] = array("I", block_tokens(block, size))
                if j >= full:
                    break
                key = (parent, block)
                h = memo.get(key)
                if h is None:
                    h = memo[key] = hasher.hash_page(parent, toks)
                hashes.append(h)
                parent = h
            out.append(
                SimRequest(
                    f"req-{i}",
                    float(req.timestamp_ms),
                    req.input_length,
                    req.output_length,
                    req.hash_ids,
                    tuple(hashes),
                )
            )
        self.hasher = hasher
        self.requests = out
        self._tokens = tokens
        self.bound_hit_ratio = infinite_cache_hit_ratio(trace)

    def token_ids(self, req: SimRequest) -> array[int]:
        """The request's prompt tokens (its blocks' tokens, cut to its input length), packed."""
        out: array[int] = array("I")
        extend = out.extend
        tokens = self._tokens
        for block in req.block_ids:
            extend(tokens[block])
        del out[req.input_tokens :]
        return out

    def request_hashes(self, req: SimRequest) -> RequestHashes:
        """`RequestHashes` of the request, filled from the precomputed chain (no rehash).

        The token ids stay a packed uint32 array rather than a list of ints:
        the cache manager and pool only take its length and slices, and
        building 12,000-int lists per request was half of a replay's time.
        """
        rh = RequestHashes(self.hasher)
        rh.token_ids = cast(list[int], self.token_ids(req))
        rh.hashes = list(req.page_hashes)
        return rh

    @property
    def max_pages(self) -> int:
        return max((r.num_pages for r in self.requests), default=0)

    def with_flood(
        self, per_request: float, tenant: str = FLOOD_TENANT, base_tenant: str = QUIET_TENANT
    ) -> PreparedTrace:
        """This trace as `base_tenant`'s, beside a neighbour `tenant` flooding unique prompts.

        Request i gets ``floor((i + 1) * per_request) - floor(i * per_request)`` flooding
        requests of its length, arriving with it (0.5: one every other request); their
        pages are hashed under a cache salt of their own (one per
        request), so none of them is ever reused, as a tenant sending unique prompts.
        The base tenant's hashes stay as they are (a salt changes hash values, not
        which pages repeat); `bound_hit_ratio` stays the base tenant's alone.
        """
        if not per_request >= 0 or math.isinf(per_request):
            raise ConfigError(
                f"flooding requests per request (--flood) must be >= 0, got {per_request}"
            )
        hasher, size = self.hasher, self.hasher.page_size
        out: list[SimRequest] = []
        for i, req in enumerate(self.requests):
            out.append(replace(req, tenant=base_tenant))
            for k in range(math.floor((i + 1) * per_request) - math.floor(i * per_request)):
                salt = ("cache_salt", f"{tenant}-{i}-{k}")
                parent: PageHash | None = None
                hashes: list[PageHash] = []
                for block in req.block_ids[: len(req.page_hashes)]:
                    parent = hasher.hash_page(parent, self._tokens[block][:size], salt)
                    hashes.append(parent)
                out.append(
                    SimRequest(
                        f"{req.request_id}-flood-{k}",
                        req.arrival_ms,
                        req.input_tokens,
                        req.output_tokens,
                        req.block_ids,
                        tuple(hashes),
                        tenant,
                    )
                )
        flooded = object.__new__(PreparedTrace)
        flooded.hasher = hasher
        flooded.requests = out
        flooded._tokens = self._tokens
        flooded.bound_hit_ratio = self.bound_hit_ratio
        return flooded


def prepare_trace(
    trace: Sequence[TraceRequest], page_size: int = TRACE_BLOCK_TOKENS
) -> PreparedTrace:
    """Hash a trace's pages with the real `PageHasher` (default seed and algorithm)."""
    return PreparedTrace(trace, PageHasher(page_size))


# ------------------------------------------------------------------ the replay


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """What happened to one request."""

    request_id: str
    worker_id: WorkerId
    arrival_ms: float
    start_ms: float
    first_token_ms: float
    num_pages: int
    hit_pages: int
    pulled_pages: int
    computed_tokens: int
    promoted_pages: int = 0
    """Of `hit_pages`, those promoted from the host or disk tier."""
    tenant: str = DEFAULT_TENANT

    @property
    def ttft_ms(self) -> float:
        return self.first_token_ms - self.arrival_ms


@dataclass(slots=True)
class _Job:
    """A request from routing to the end of its decode (mutable bookkeeping)."""

    req: SimRequest
    decision: RouteDecision
    est_tokens: int
    cm_request: Request | None = None
    start_ms: float = 0.0
    end_ms: float = 0.0
    hit_pages: int = 0
    pulled_pages: int = 0
    computed_tokens: int = 0
    work_tokens: int = 0
    held_pages: int = 0
    promote_ms: float = 0.0  # promotions done for this request so far (a retried start keeps them)
    promoted_pages: int = 0


class SimWorker:
    """One simulated worker: a real pool and cache manager, a prefill queue, its load.

    With host or disk pages (`SimSettings.tiered`), the worker's real `TieredCache`
    sits under the pool: evicted pages spill down, hits below are promoted, every
    move is an event. The KV store under it holds one value per page (the
    simulator moves no KV, only time is modelled).
    """

    __slots__ = (
        "active_requests",
        "busy_ms",
        "decode_pages",
        "incarnation",
        "manager",
        "pool",
        "prefill_tokens",
        "queue",
        "running",
        "seq",
        "tiers",
        "worker_id",
    )

    def __init__(
        self,
        worker_id: WorkerId,
        capacity_pages: int,
        page_size: int,
        settings: SimSettings | None = None,
        disk_dir: Path | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.incarnation = f"{worker_id}-sim"
        # Only the index reads the events here, and it keys on hashes alone.
        self.pool = PagePool(
            capacity_pages + 1, page_size=page_size, medium="gpu", event_token_ids=False
        )
        self.tiers: TieredCache | None = None
        if settings is not None and settings.tiered:
            self.tiers = _tiered_cache(self.pool, worker_id, settings, disk_dir)
        self.manager = KVCacheManager(self.pool, page_size)
        self.queue: deque[_Job] = deque()
        self.running: _Job | None = None
        self.seq = 0
        self.busy_ms = 0.0
        self.prefill_tokens = 0
        self.decode_pages = 0
        self.active_requests = 0

    def load(self, capacity_pages: int, now_ms: float) -> WorkerLoad:
        """The load a heartbeat would report at `now_ms`.

        Active prefill tokens are the queued requests' uncached tokens plus
        the part of the running prefill not computed yet (linear in time);
        pulls count as the tokens their time would compute
        (`TimeModel.work_tokens`).
        """
        tokens = self.prefill_tokens
        job = self.running
        if job is not None and job.end_ms > job.start_ms:
            done = (now_ms - job.start_ms) / (job.end_ms - job.start_ms)
            tokens -= int(job.work_tokens * min(max(done, 0.0), 1.0))
        return WorkerLoad(
            self.worker_id,
            tokens,
            self.decode_pages,
            self.pool.get_num_free_pages(),
            capacity_pages,
            active_requests=self.active_requests,
        )


def _tiered_cache(
    pool: PagePool, worker_id: WorkerId, settings: SimSettings, disk_dir: Path | None
) -> TieredCache:
    """The worker's real tiers under a simulated pool, sized in pages."""
    store = KVStore(pool.num_pages, 1, 1, 1, 1, _SIM_DTYPE)
    disk_bytes = 0
    folder: Path | None = None
    if settings.disk_pages:
        if disk_dir is None:
            raise InvalidInput("a simulated disk tier needs a folder for its page files")
        folder = disk_dir / str(worker_id)
        disk_bytes = settings.disk_pages * _disk_file_bytes(store)
    return TieredCache(
        pool,
        store,
        host_pages=settings.host_pages,
        disk_dir=folder,
        disk_bytes=disk_bytes,
        disk_fsync=False,
        disk_adopt=False,
        eviction=settings.eviction,
        weights=TenantWeights.parse(settings.tenant_weights),
        pin_memory=False,
        worker=str(worker_id),
    )


_SIM_DTYPE = "float16"


def _disk_file_bytes(store: KVStore) -> int:
    """The size of one page file of `store`'s pages (a 32-byte hash and parent, a named tenant)."""
    page = torch.zeros(store.page_shape, dtype=store.dtype)
    meta = PageMeta(PageHash(bytes(32)), PageHash(bytes(32)), None, tenant_of("sim"))
    head, data = encode_page_file(meta, page_blob(page, store.dtype_name))
    return len(head) + len(data)


@dataclass(frozen=True, slots=True)
class SimResult:
    """A finished replay of one policy."""

    policy: str
    timings: tuple[RequestTiming, ...]
    busy_ms: tuple[float, ...]
    route_s: float
    bound_hit_ratio: float
    total_tokens: int


_DECODE_END, _PREFILL_END = 0, 1
"""Event kinds; at equal times frees come first, then prefill ends, then arrivals."""


class Simulation:
    """One replay of a prepared trace under one policy (fresh pools and index).

    `timer` measures the routing decisions (wall time, seconds); everything
    else runs on simulated time.
    """

    def __init__(
        self,
        trace: PreparedTrace,
        policy: RoutingPolicy,
        settings: SimSettings,
        *,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        if settings.page_size != trace.hasher.page_size:
            raise ConfigError(
                f"settings page_size {settings.page_size} differs from the trace's "
                f"{trace.hasher.page_size}"
            )
        if trace.max_pages > settings.capacity_pages:
            raise ConfigError(
                f"--capacity-pages {settings.capacity_pages} cannot hold the trace's longest "
                f"prompt ({trace.max_pages} pages); raise it to at least {trace.max_pages}"
            )
        self.trace = trace
        self.policy = policy
        self.settings = settings
        self.timer = timer
        self.index = GlobalIndex()
        # with several tenants, the router counts their pages from the events, as the coordinator does
        self.tenant_shares: TenantShares | None = None
        if len({r.tenant for r in trace.requests}) > 1:
            self.tenant_shares = TenantShares(TenantWeights.parse(settings.tenant_weights))
            self.index.add_observer(self.tenant_shares)
        self._disk_dir: tempfile.TemporaryDirectory[str] | None = None
        if settings.disk_pages:
            self._disk_dir = tempfile.TemporaryDirectory(prefix="kvmesh-sim-disk-")
        disk_dir = Path(self._disk_dir.name) if self._disk_dir is not None else None
        self.workers = [
            SimWorker(
                WorkerId(f"worker-{i}"),
                settings.capacity_pages,
                settings.page_size,
                settings,
                disk_dir,
            )
            for i in range(settings.workers)
        ]
        self._by_id = {w.worker_id: w for w in self.workers}
        for w in self.workers:
            self.index.register_worker(w.worker_id, w.incarnation)
        self._heap: list[tuple[float, int, int, SimWorker, _Job]] = []
        self._order = 0
        self._now = 0.0
        self._timings: list[RequestTiming] = []
        self._route_s = 0.0
        self._ran = False
        self._pull = settings.pull and settings.time.pull_pays(settings.page_size)

    # ------------------------------------------------------------------ driver

    def run(self) -> SimResult:
        """Replay every request in arrival order; returns the timings and busy times."""
        if self._ran:
            raise InvalidInput("a Simulation replays once; build a new one for another run")
        self._ran = True
        try:
            self._replay()
        finally:
            if self._disk_dir is not None:
                self._disk_dir.cleanup()
        for w in self.workers:
            if w.queue or w.running is not None:
                raise InvariantViolation(
                    f"{w.worker_id} ended with {len(w.queue)} queued requests "
                    f"and running={w.running is not None}"
                )
        return SimResult(
            getattr(self.policy, "name", type(self.policy).__name__),
            tuple(self._timings),
            tuple(w.busy_ms for w in self.workers),
            self._route_s,
            self.trace.bound_hit_ratio,
            sum(r.input_tokens for r in self.trace.requests),
        )

    def _replay(self) -> None:
        heap = self._heap
        for req in sorted(self.trace.requests, key=lambda r: r.arrival_ms):
            while heap and heap[0][0] <= req.arrival_ms:
                self._step()
            self._now = req.arrival_ms
            self._arrive(req)
        while heap:
            self._step()
        for w in self.workers:
            if w.tiers is not None:
                w.tiers.check_invariants()

    def _push(self, at: float, kind: int, worker: SimWorker, job: _Job) -> None:
        self._order += 1
        heapq.heappush(self._heap, (at, kind, self._order, worker, job))

    def _step(self) -> None:
        at, kind, _, worker, job = heapq.heappop(self._heap)
        self._now = at
        if kind == _PREFILL_END:
            self._end_prefill(worker, job)
        else:
            self._end_decode(worker, job)

    def _flush(self, w: SimWorker) -> None:
        """Send the worker's pending KV events to the index as its next batch."""
        events = w.pool.take_events()
        if not events:
            return
        batch = EventBatch(tuple(events), w.worker_id, w.incarnation, w.seq, self._now / 1000.0)
        w.seq += 1
        result = self.index.apply(batch)
        if result is not ApplyResult.APPLIED:
            raise InvariantViolation(
                f"index answered {result.value} to batch {batch.seq} of {w.worker_id}"
            )

    # ----------------------------------------------------------------- routing

    def _arrive(self, req: SimRequest) -> None:
        cap = self.settings.capacity_pages
        loads = [w.load(cap, self._now) for w in self.workers]
        size = self.settings.page_size
        t0 = self.timer()
        crowded = self.tenant_shares.over_share_pages(req.tenant) if self.tenant_shares else None
        route = RouteRequest(
            req.page_hashes, req.input_tokens, size, self._pull, req.request_id, crowded
        )
        matched = self.index.match(req.page_hashes)
        tiers = self.index.tier_pages(req.page_hashes, matched)
        if tiers:
            decision = self.policy.choose(route, matched.pages, loads, tiers)
        else:  # a policy written before tiers takes three arguments
            decision = self.policy.choose(route, matched.pages, loads)
        self._route_s += self.timer() - t0
        worker = self._by_id.get(decision.worker_id)
        if worker is None:
            raise InvariantViolation(f"policy chose unknown worker {decision.worker_id!r}")
        max_hit = self._max_hit_pages(req)
        local = min(decision.local_pages, max_hit)
        pulls = (
            min(decision.local_pages + decision.peer_pages, max_hit) - local if self._pull else 0
        )
        promote = self.settings.time.promote_ms(min(decision.promote_pages, local), 0)
        est = self.settings.time.work_tokens(
            req.input_tokens - (local + pulls) * size, pulls, promote
        )
        job = _Job(req, decision, est)
        worker.queue.append(job)
        worker.prefill_tokens += est
        worker.active_requests += 1
        if worker.running is None:
            self._start_prefill(worker)

    def _max_hit_pages(self, req: SimRequest) -> int:
        """Pages a prefix hit may cover: never the last token (as `get_computed_pages`)."""
        return reusable_pages(req.input_tokens, self.settings.page_size)

    # ------------------------------------------------------------------ worker

    def _start_prefill(self, w: SimWorker) -> None:
        """Start the head of `w`'s queue if its pages fit; otherwise wait for a free."""
        if w.running is not None or not w.queue:
            return
        job = w.queue[0]
        req = job.req
        size = self.settings.page_size
        if job.cm_request is None:
            job.cm_request = Request(
                req.request_id, self.trace.request_hashes(req), tenant=req.tenant
            )
        cm_req = job.cm_request
        if w.tiers is not None:
            self._promote(w, job)
        hits, hit_tokens = w.manager.get_computed_pages(cm_req)
        h = len(hits)
        peer_pages: list[KVPage] = []
        peer: SimWorker | None = None
        if self._pull and job.decision.peer_id is not None:
            peer = self._by_id[job.decision.peer_id]
            found = peer.pool.match_prefix(req.page_hashes, self._max_hit_pages(req))
            peer_pages = found[h:]
        pulled = len(peer_pages)
        new = w.manager.allocate_slots(
            cm_req,
            req.input_tokens - hit_tokens,
            hit_tokens,
            hits,
            delay_caching=True,
        )
        if new is None:
            if w.active_requests - len(w.queue) == 0:
                raise InvariantViolation(
                    f"{w.worker_id}: {req.request_id} ({req.num_pages} pages) does not fit "
                    f"in an idle pool of {self.settings.capacity_pages} pages"
                )
            return  # retried when a decode on this worker frees pages
        w.queue.popleft()
        if peer is not None and peer_pages:
            # The peer pins the pages while it streams them out, then unpins.
            peer.pool.touch(peer_pages)
            peer.pool.free_pages(reversed(peer_pages))
        computed = req.input_tokens - (h + pulled) * size
        duration = self.settings.time.prefill_ms(computed, pulled, job.promote_ms)
        job.start_ms = self._now
        job.end_ms = self._now + duration
        job.hit_pages = h
        job.pulled_pages = pulled
        job.computed_tokens = computed
        job.work_tokens = self.settings.time.work_tokens(computed, pulled, job.promote_ms)
        job.held_pages = len(w.manager.get_pages(req.request_id))
        w.running = job
        w.busy_ms += duration
        w.prefill_tokens += job.work_tokens - job.est_tokens
        self._push(self._now + duration, _PREFILL_END, w, job)
        self._flush(w)

    def _promote(self, w: SimWorker, job: _Job) -> None:
        """Promote the lower tiers' pages extending the device's prefix, and charge their time.

        The tier each page comes from is read before the promotion (which moves
        it); promoted pages are then device hits for the cache manager's lookup.
        """
        tiers = w.tiers
        if tiers is None:
            return
        hashes = job.req.page_hashes
        limit = min(self._max_hit_pages(job.req), len(hashes))
        start = len(w.pool.match_prefix(hashes, limit))
        sources: list[str] = []
        for i in range(start, limit):
            tier = tiers.tier_of(hashes[i])
            if tier is None or tier == "gpu":
                break
            sources.append(tier)
        if not sources:
            return
        n = tiers.promote(hashes, limit)
        moved = sources[:n]
        disk = moved.count("disk")
        job.promote_ms += self.settings.time.promote_ms(len(moved) - disk, disk)
        job.promoted_pages += n

    def _end_prefill(self, w: SimWorker, job: _Job) -> None:
        req = job.req
        if job.cm_request is None:
            raise InvariantViolation(f"{req.request_id} ended a prefill it never started")
        w.manager.cache_pages(job.cm_request, req.input_tokens)
        self._flush(w)
        w.running = None
        w.prefill_tokens -= job.work_tokens
        w.decode_pages += job.held_pages
        self._timings.append(
            RequestTiming(
                req.request_id,
                w.worker_id,
                req.arrival_ms,
                job.start_ms,
                self._now,
                req.num_pages,
                job.hit_pages,
                job.pulled_pages,
                job.computed_tokens,
                job.promoted_pages,
                req.tenant,
            )
        )
        decode_ms = req.output_tokens * self.settings.time.decode_token_ms
        self._push(self._now + decode_ms, _DECODE_END, w, job)
        self._start_prefill(w)

    def _end_decode(self, w: SimWorker, job: _Job) -> None:
        w.manager.free(job.req.request_id)
        w.decode_pages -= job.held_pages
        w.active_requests -= 1
        self._flush(w)
        if w.running is None:
            self._start_prefill(w)


__all__ = [
    "PreparedTrace",
    "RequestTiming",
    "SimRequest",
    "SimResult",
    "SimSettings",
    "SimWorker",
    "Simulation",
    "TimeModel",
    "prepare_trace",
]
