"""Routing policies: pick the worker for a request from prefix overlap and load.

Pure (no Ray, no gRPC). A policy gets the request (its page hashes and token
count), the index's longest held prefix per worker (`GlobalIndex.match`) and
each worker's load, and returns a `RouteDecision`. Policies are a registry
(`REGISTRY`, name -> class) built by `make_policy`; each one takes the
`CoordinatorConfig` and an injected `random.Random`, so runs are repeatable.

Every policy handles degraded workers the same way, through `candidates`:
workers are ranked healthy < stale < full < draining and only the best
non-empty rank is considered. A stale worker's overlap counts as zero (its
entries are not trusted), so it is never chosen for cache affinity, and it,
a full or a draining worker is still chosen when nothing better exists. With
no worker at all, `NoWorkers` is raised.

Every decision also names the non-stale peer holding the longest prefix when
that prefix is longer than the chosen worker's, so the worker can pull the
difference instead of computing it.
"""

from __future__ import annotations

import bisect
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

import xxhash

from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.tiers import TierCosts, TierPages
from kvmesh.errors import ConfigError, InvalidInput, NoWorkers
from kvmesh.load import WorkerLoad  # re-exported: callers still import it from here
from kvmesh.requests import RouteDecision  # re-exported, as WorkerLoad
from kvmesh.types import PageHash, WorkerId

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy needs to know of a request: its full-page hashes and token count."""

    hashes: Sequence[PageHash]
    num_tokens: int
    page_size: int = 16
    allow_pull: bool = False
    request_id: str = ""
    tenant_pages: Mapping[WorkerId, int] | None = None
    """Given when the request's tenant holds more than its fair share of the cluster's
    pages: the pages it holds on each worker (`coordinator.tenant_shares`)."""

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise InvalidInput(f"page_size must be positive, got {self.page_size}")
        if self.num_tokens < 0:
            raise InvalidInput(f"num_tokens must be >= 0, got {self.num_tokens}")

    @property
    def num_pages(self) -> int:
        """Pages the prompt occupies (a partial last page counts)."""
        return max(len(self.hashes), -(-self.num_tokens // self.page_size))


class RoutingPolicy(Protocol):
    """What every policy offers; `choose` raises `NoWorkers` on an empty `loads`."""

    name: ClassVar[str]

    def __init__(self, config: CoordinatorConfig, rng: random.Random) -> None: ...

    def choose(
        self,
        request: RouteRequest,
        overlaps: Mapping[WorkerId, int],
        loads: Sequence[WorkerLoad],
        tiers: Mapping[WorkerId, TierPages] | None = None,
    ) -> RouteDecision: ...


@dataclass(frozen=True, slots=True)
class Candidates:
    """The workers a policy may choose from, with the overlap it may count for each.

    `holders`: every non-stale worker (any rank) holding part of the prefix,
    with its overlap: where a peer to pull from is looked for.
    """

    loads: list[WorkerLoad]
    overlaps: list[int]
    degraded: bool
    holders: list[tuple[int, WorkerLoad]]


def candidates(
    request: RouteRequest, overlaps: Mapping[WorkerId, int], loads: Sequence[WorkerLoad]
) -> Candidates:
    """The best non-empty rank of healthy < stale < full < draining workers. One pass."""
    if not loads:
        raise NoWorkers("no worker is registered: start workers before routing requests")
    need = request.num_pages
    get = overlaps.get
    best_rank = 4
    picked: list[WorkerLoad] = []
    picked_ov: list[int] = []
    holders: list[tuple[int, WorkerLoad]] = []
    for load in loads:
        if load.stale:
            ov = 0
        else:
            ov = get(load.worker_id, 0)
            if ov > 0:
                holders.append((ov, load))
        if load.draining:
            rank = 3
        elif load.total_pages > 0 and load.free_pages < need - ov:
            rank = 2
        elif load.stale:
            rank = 1
        else:
            rank = 0
        if rank == best_rank:
            picked.append(load)
            picked_ov.append(ov)
        elif rank < best_rank:
            best_rank = rank
            picked, picked_ov = [load], [ov]
    return Candidates(picked, picked_ov, best_rank > 0, holders)


def best_peer(
    cands: Candidates, page_size: int, exclude: WorkerId | None = None
) -> tuple[WorkerId | None, int]:
    """The non-stale worker with the longest prefix (least loaded, then smallest id, on ties)."""
    best: WorkerLoad | None = None
    best_n = 0
    best_key: tuple[float, str] | None = None
    for n, load in cands.holders:
        if n < best_n or load.worker_id == exclude:
            continue
        if n > best_n or best is None:
            best, best_n, best_key = load, n, None
            continue
        if best_key is None:
            best_key = (best.load_pages(page_size), best.worker_id)
        key = (load.load_pages(page_size), load.worker_id)
        if key < best_key:
            best, best_key = load, key
    return (None, 0) if best is None else (best.worker_id, best_n)


def decide(
    name: str,
    request: RouteRequest,
    cands: Candidates,
    i: int,
    cost: float = 0.0,
) -> RouteDecision:
    """The decision for candidate `i`, naming the peer that holds more, if any."""
    chosen = cands.loads[i]
    local = cands.overlaps[i]
    peer, peer_n = best_peer(cands, request.page_size, exclude=chosen.worker_id)
    if peer is None or peer_n <= local:
        peer, extra = None, 0
    else:
        extra = peer_n - local
    return RouteDecision(
        chosen.worker_id,
        local,
        peer,
        extra,
        request.num_pages,
        name,
        cost,
        cands.degraded,
    )


def _pick_min(keys: Sequence[float], loads: Sequence[WorkerLoad], rng: random.Random) -> int:
    """Index of the smallest key; ties by lower load, then uniformly at random."""
    lo = min(keys)
    tied = [i for i, k in enumerate(keys) if k <= lo + _EPS]
    if len(tied) > 1:
        load_keys = [(loads[i].active_prefill_tokens, loads[i].active_decode_pages) for i in tied]
        best = min(load_keys)
        tied = [i for i, k in zip(tied, load_keys, strict=True) if k == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


class CandidatePolicy(ABC):
    """What the built-in policies share: gather the candidates, `pick` one, decide.

    A subclass states only how it picks: the index of a candidate in
    ``cands.loads`` and the cost it saw (reported with the decision).
    """

    name: ClassVar[str]

    def choose(
        self,
        request: RouteRequest,
        overlaps: Mapping[WorkerId, int],
        loads: Sequence[WorkerLoad],
        tiers: Mapping[WorkerId, TierPages] | None = None,
    ) -> RouteDecision:
        """`tiers`: `GlobalIndex.tier_pages` (workers absent hold their prefix on the device);
        only `kv_aware` weighs it."""
        cands = candidates(request, overlaps, loads)
        i, cost = self.pick(request, cands)
        return decide(self.name, request, cands, i, cost)

    @abstractmethod
    def pick(self, request: RouteRequest, cands: Candidates) -> tuple[int, float]:
        """The chosen candidate's index in ``cands.loads`` and its cost."""


class KVAwarePolicy(CandidatePolicy):
    """Dynamo-style cost, minimum wins (or softmax-sampled with `temperature` > 0)::

        cost = overlap_weight * (pages_to_prefill + queue_weight * queued_prefill_pages)
             + decode_weight * active_decode_pages

    `pages_to_prefill` is the prompt's pages minus the worker's held prefix;
    with `request.allow_pull`, pages a peer holds beyond it count `pull_cost`
    each instead of 1. Held pages in the worker's host or disk tier (`tiers`,
    from `GlobalIndex.tier_pages`) count `host_hit_cost` / `disk_hit_cost`
    each (`coordinator.tiers.TierCosts`), so route, promotion, pull and
    recomputation are weighed in one cost; the decision names the pages to
    promote. A request whose tenant is above its fair share of the cluster
    (`request.tenant_pages`) is charged ``tenant_share_weight`` per page it
    would store beyond what that tenant already holds on the worker: the
    pages it would take from other tenants there, so a flooding tenant fills
    the workers it already crowds. The queued prefill term is what makes a worker that
    holds the prefix but has a long queue lose to an idle one: the cost is,
    in pages, the prefill work the request waits for. `max_load_ratio` > 0
    additionally skips workers whose queued prefill plus this request's
    exceeds that multiple of the mean (bounded load), unless all do.
    """

    name: ClassVar[str] = "kv_aware"

    def __init__(self, config: CoordinatorConfig, rng: random.Random) -> None:
        if config.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {config.temperature}")
        if not 0 <= config.pull_cost <= 1:
            raise ConfigError(f"pull_cost must be in [0, 1], got {config.pull_cost}")
        self.overlap_weight = config.overlap_weight
        self.decode_weight = config.decode_weight
        self.queue_weight = config.queue_weight
        self.temperature = config.temperature
        self.max_load_ratio = config.max_load_ratio
        self.tier_costs = TierCosts.from_config(config)
        self.tenant_share_weight = config.tenant_share_weight
        self.rng = rng

    def choose(
        self,
        request: RouteRequest,
        overlaps: Mapping[WorkerId, int],
        loads: Sequence[WorkerLoad],
        tiers: Mapping[WorkerId, TierPages] | None = None,
    ) -> RouteDecision:
        cands = candidates(request, overlaps, loads)
        i, cost = self._pick(request, cands, tiers)
        decision = decide(self.name, request, cands, i, cost)
        held = tiers.get(decision.worker_id) if tiers else None
        if held is None or not held.lower or not decision.local_pages:
            return decision
        return replace(decision, promote_pages=min(held.lower, decision.local_pages))

    def pick(self, request: RouteRequest, cands: Candidates) -> tuple[int, float]:
        return self._pick(request, cands, None)

    def _pick(
        self,
        request: RouteRequest,
        cands: Candidates,
        tiers: Mapping[WorkerId, TierPages] | None,
    ) -> tuple[int, float]:
        peer_n = best_peer(cands, request.page_size)[1] if request.allow_pull else 0
        costs = self.costs(request, cands, peer_n, tiers)
        if request.tenant_pages is not None and self.tenant_share_weight > 0:
            costs = self._over_share(request, cands, costs, request.tenant_pages)
        keys = costs
        if self.max_load_ratio > 0:
            allowed = self._bounded(request, cands)
            keys = [c if ok else math.inf for c, ok in zip(costs, allowed, strict=True)]
        sample = self.temperature > 0
        i = self._sample(keys) if sample else _pick_min(keys, cands.loads, self.rng)
        return i, costs[i]

    def costs(
        self,
        request: RouteRequest,
        cands: Candidates,
        peer_n: int = 0,
        tiers: Mapping[WorkerId, TierPages] | None = None,
    ) -> list[float]:
        """Each candidate's cost; `peer_n`: the longest prefix a peer holds (pulls);
        `tiers`: where each worker's held prefix lives (absent: on the device).

        A worker whose tier count covers more than the overlap it may claim (stale, or a
        match clamped) is charged its lower-tier pages in proportion.
        """
        total = request.num_pages
        w, dw, saved = self.overlap_weight, self.decode_weight, self.tier_costs.pull_saves
        qw = self.queue_weight / request.page_size
        if peer_n <= 0 and not tiers:  # the common case: one comprehension
            return [
                w * (total - local + qw * load.active_prefill_tokens)
                + dw * load.active_decode_pages
                for load, local in zip(cands.loads, cands.overlaps, strict=True)
            ]
        prefix_cost = self.tier_costs.prefix_cost
        out: list[float] = []
        for load, local in zip(cands.loads, cands.overlaps, strict=True):
            prefill = float(total - local)
            held = tiers.get(load.worker_id) if tiers else None
            if held is not None and local > 0 and held.total > 0:
                prefill += prefix_cost(held) * min(1.0, local / held.total)
            if peer_n > local:
                prefill -= (peer_n - local) * saved
            out.append(
                w * (prefill + qw * load.active_prefill_tokens) + dw * load.active_decode_pages
            )
        return out

    def _over_share(
        self,
        request: RouteRequest,
        cands: Candidates,
        costs: list[float],
        tenant_pages: Mapping[WorkerId, int],
    ) -> list[float]:
        """`costs` plus, per worker, the pages an over-share tenant would take from others."""
        total, wt = request.num_pages, self.tenant_share_weight
        return [
            c + wt * max(0, total - local - tenant_pages.get(load.worker_id, 0))
            for c, load, local in zip(costs, cands.loads, cands.overlaps, strict=True)
        ]

    def _bounded(self, request: RouteRequest, cands: Candidates) -> list[bool]:
        """Consistent-hashing-with-bounded-loads rule, in pages of queued prefill.

        A worker may take the request while its queue is at most
        ``max_load_ratio * (all queued + this request's pages) / workers``.
        """
        n = len(cands.loads)
        if self.max_load_ratio <= 0 or n < 2:
            return [True] * n
        size = request.page_size
        queued = [load.active_prefill_tokens / size for load in cands.loads]
        cap = self.max_load_ratio * (sum(queued) + request.num_pages) / n
        ok = [q <= cap for q in queued]
        return ok if any(ok) else [True] * n

    def _sample(self, keys: Sequence[float]) -> int:
        finite = [k for k in keys if k != math.inf]
        lo, hi = min(finite), max(finite)
        span = hi - lo or 1.0
        weights = [
            0.0 if k == math.inf else math.exp(-(k - lo) / span / self.temperature) for k in keys
        ]
        r = self.rng.random() * sum(weights)
        for i, wt in enumerate(weights):
            r -= wt
            if r < 0 and wt > 0:
                return i
        return max(i for i, wt in enumerate(weights) if wt > 0)


class RoundRobinPolicy(CandidatePolicy):
    """Each request to the next candidate, in worker-id order."""

    name: ClassVar[str] = "round_robin"

    def __init__(self, config: CoordinatorConfig, rng: random.Random) -> None:
        self._next = 0

    def pick(self, request: RouteRequest, cands: Candidates) -> tuple[int, float]:
        order = sorted(range(len(cands.loads)), key=lambda j: cands.loads[j].worker_id)
        i = order[self._next % len(order)]
        self._next += 1
        return i, 0.0


class RandomPolicy(CandidatePolicy):
    """A uniformly random candidate."""

    name: ClassVar[str] = "random"

    def __init__(self, config: CoordinatorConfig, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, request: RouteRequest, cands: Candidates) -> tuple[int, float]:
        i = self.rng.randrange(len(cands.loads))
        return i, 0.0


class LeastLoadedPolicy(CandidatePolicy):
    """The candidate with the least queued prefill plus decode pages; ties at random."""

    name: ClassVar[str] = "least_loaded"

    def __init__(self, config: CoordinatorConfig, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, request: RouteRequest, cands: Candidates) -> tuple[int, float]:
        keys = [load.load_pages(request.page_size) for load in cands.loads]
        i = _pick_min(keys, cands.loads, self.rng)
        return i, keys[i]


class ConsistentHashPolicy(CandidatePolicy):
    """Prefix affinity on a hash ring with bounded load.

    The key is the hash of page `consistent_hash_pages - 1` (a chained hash
    names the whole leading prefix), so requests sharing only a system prompt
    shorter than that spread out. Even when every request has the same key,
    the ring walk skips workers whose load exceeds
    `consistent_hash_load_factor` x the mean load including this request
    (consistent hashing with bounded loads, Mirrokni et al.), so one worker
    never takes everything.
    """

    name: ClassVar[str] = "consistent_hash"

    def __init__(self, config: CoordinatorConfig, rng: random.Random) -> None:
        if config.consistent_hash_pages < 1 or config.consistent_hash_vnodes < 1:
            raise ConfigError("consistent_hash_pages and consistent_hash_vnodes must be >= 1")
        if config.consistent_hash_load_factor < 1:
            raise ConfigError(
                f"consistent_hash_load_factor must be >= 1, got {config.consistent_hash_load_factor}"
            )
        self.key_pages = config.consistent_hash_pages
        self.vnodes = config.consistent_hash_vnodes
        self.load_factor = config.consistent_hash_load_factor
        self.rng = rng
        self._ring_of: tuple[WorkerId, ...] = ()
        self._points: list[int] = []
        self._owners: list[WorkerId] = []

    def _ring(self, workers: tuple[WorkerId, ...]) -> None:
        if workers == self._ring_of:
            return
        pts = sorted(
            (xxhash.xxh3_64_intdigest(f"{wid}#{v}".encode()), wid)
            for wid in workers
            for v in range(self.vnodes)
        )
        self._points = [p for p, _ in pts]
        self._owners = [w for _, w in pts]
        self._ring_of = workers

    def pick(self, request: RouteRequest, cands: Candidates) -> tuple[int, float]:
        by_id = {load.worker_id: i for i, load in enumerate(cands.loads)}
        self._ring(tuple(sorted(by_id)))
        size = request.page_size
        if request.hashes:
            key_hash = request.hashes[min(self.key_pages, len(request.hashes)) - 1]
            point = xxhash.xxh3_64_intdigest(key_hash)
        else:
            point = self.rng.getrandbits(64)
        need = request.num_pages
        load_of = [load.load_pages(size) for load in cands.loads]
        cap = self.load_factor * (sum(load_of) + need) / len(load_of)
        start = bisect.bisect_left(self._points, point)
        ring_n = len(self._points)
        seen: set[WorkerId] = set()
        for k in range(ring_n):
            wid = self._owners[(start + k) % ring_n]
            if wid in seen:
                continue
            seen.add(wid)
            i = by_id[wid]
            if load_of[i] <= cap:
                return i, load_of[i]
            if len(seen) == len(by_id):
                break
        i = _pick_min(load_of, cands.loads, self.rng)
        return i, load_of[i]


class CacheAwarePolicy(CandidatePolicy):
    """SGLang router's cache-aware policy.

    Load imbalanced (max - min active requests > `balance_abs_threshold` and
    max > `balance_rel_threshold` x min): shortest queue. Otherwise the
    worker with the longest prefix if its match rate (held pages / prompt
    pages) exceeds `cache_threshold`, else the least loaded.
    """

    name: ClassVar[str] = "cache_aware"

    def __init__(self, config: CoordinatorConfig, rng: random.Random) -> None:
        if not 0 <= config.cache_threshold <= 1:
            raise ConfigError(f"cache_threshold must be in [0, 1], got {config.cache_threshold}")
        self.cache_threshold = config.cache_threshold
        self.abs_threshold = config.balance_abs_threshold
        self.rel_threshold = config.balance_rel_threshold
        self.rng = rng

    def pick(self, request: RouteRequest, cands: Candidates) -> tuple[int, float]:
        queue = [load.active_requests for load in cands.loads]
        lo, hi = min(queue), max(queue)
        imbalanced = hi - lo > self.abs_threshold and hi > self.rel_threshold * lo
        if not imbalanced:
            best = max(cands.overlaps)
            total = request.num_pages
            if best > 0 and total > 0 and best / total > self.cache_threshold:
                keys = [float(-ov) for ov in cands.overlaps]
                i = _pick_min(keys, cands.loads, self.rng)
                return i, keys[i]
        keys = [float(q) for q in queue]
        i = _pick_min(keys, cands.loads, self.rng)
        return i, keys[i]


REGISTRY: dict[str, type[RoutingPolicy]] = {
    cls.name: cls
    for cls in (
        KVAwarePolicy,
        RoundRobinPolicy,
        RandomPolicy,
        LeastLoadedPolicy,
        ConsistentHashPolicy,
        CacheAwarePolicy,
    )
}
"""Policy name -> class; every class is built as ``cls(config, rng)``."""


def make_policy(
    name: str, config: CoordinatorConfig | None = None, rng: random.Random | None = None
) -> RoutingPolicy:
    """Build a policy by name; raises `ConfigError` naming the known ones."""
    cls = REGISTRY.get(name)
    if cls is None:
        raise ConfigError(f"unknown routing policy {name!r}; choose one of {sorted(REGISTRY)}")
    cfg = config or CoordinatorConfig()
    return cls(cfg, rng if rng is not None else random.Random(cfg.seed))


class Policies:
    """The policies a coordinator or router decides with, by name, each built on first use
    and kept: a policy has state of its own (round robin's turn, the generator it draws
    from), so a route naming one must meet the instance the last route used."""

    def __init__(self, config: CoordinatorConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        self._built: dict[str, RoutingPolicy] = {}

    @staticmethod
    def check(name: str | None) -> None:
        """Raise `ConfigError` naming the known policies if `name` is none of them (None:
        the config's), before a route changes anything."""
        if name is not None and name not in REGISTRY:
            make_policy(name)

    def get(self, name: str | None) -> RoutingPolicy:
        """The policy named `name` (None: the config's); raises `ConfigError` for unknown names."""
        key = self.config.policy if name is None else name
        policy = self._built.get(key)
        if policy is None:
            policy = self._built[key] = make_policy(key, self.config, self.rng)
        return policy
