"""Where a request goes: a coordinator policy over an index of engine blocks.

Two routers share one shape (`Router`):

- `IndexRouter`: the index is fed by the engines' own KV events (vLLM's
  ``--kv-events-config``), so it holds what the engines really cache. Any
  coordinator policy by name (`kv_aware`, `round_robin`, ...).
- `MeshRouter` (``kv_mesh``): for engines that load kvmesh's KV connector
  (`kvmesh.connector`), whose stores pull a prefix from each other. Every
  request may pull, so `kv_aware` weighs, per engine, the blocks its own
  cache holds (free), the blocks beyond them its store holds (a load, priced
  as the host tier: ``host_hit_cost`` a block; the stores publish their
  blocks as KV events, `kvmesh.worker.store_events`), the blocks another
  engine's cache or store holds beyond those (a pull through the mesh,
  ``pull_cost`` a block) and the rest (recomputed), against its load: a
  request can go to an idle engine and pull its prefix there instead of
  queueing behind the engine that holds it. The decision names the store
  blocks (``promote_pages``), the peer and its blocks: the prediction the
  gateway records.
- `HistoryRouter` (``approx_prefix``): sees no events. It records every
  decision it makes as if the chosen engine now caches the request's
  blocks, forgets the least recently routed blocks beyond an assumed
  capacity, and applies the same `kv_aware` cost to that guess. This is
  how SGLang's router and llm-d's approximate mode work; the benchmark
  measures what reading the real caches adds over it.

Decisions depend only on the index, the engines' loads and the request:
ties are broken by a random generator seeded with the request's own
hashes, so two gateways fed the same events decide the same way whatever
each routed before (`round_robin` excepted: its state is its history).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol

from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import (
    REGISTRY,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    TierPages,
    candidates,
    decide,
    make_policy,
)
from kvmesh.errors import ConfigError
from kvmesh.events import PagesRemoved, PagesStored, make_batch
from kvmesh.gateway.config import HISTORY_POLICY, MESH_POLICY
from kvmesh.load import WorkerLoad
from kvmesh.types import PageHash, WorkerId


def tie_break_key(hashes: Sequence[PageHash], token_ids: Sequence[int]) -> bytes:
    """A per-request seed: the last full block's hash (it names the whole prefix) and the length."""
    h = hashlib.sha256(len(token_ids).to_bytes(8, "big"))
    if hashes:
        h.update(hashes[-1])
    else:
        h.update(b"".join(t.to_bytes(4, "big", signed=False) for t in token_ids))
    return h.digest()


class Router(Protocol):
    """Picks an engine for a request's block hashes among `loads` (engines that are up)."""

    name: str

    def route(
        self,
        request: RouteRequest,
        loads: Sequence[WorkerLoad],
        key: bytes,
        prefilling: Prefilling | None = None,
    ) -> RouteDecision:
        """`prefilling`: the block hashes of the requests each engine is prefilling
        (`EnginePool.prefilling`): blocks it is about to cache. The same as
        ``choose(request, overlaps(request, prefilling), loads, key)``."""
        ...

    def overlaps(
        self, request: RouteRequest, prefilling: Prefilling | None = None
    ) -> dict[WorkerId, int]:
        """The leading blocks of the request the router counts as held, per engine."""
        ...

    def choose(
        self,
        request: RouteRequest,
        overlaps: Mapping[WorkerId, int],
        loads: Sequence[WorkerLoad],
        key: bytes,
    ) -> RouteDecision:
        """The decision for `overlaps` as `overlaps` returned them (the gateway records them)."""
        ...

    def stale(self) -> set[WorkerId]:
        """Engines whose index entries are not trusted now."""
        ...

    def forget(self, worker_id: WorkerId) -> None:
        """The engine went down: whatever was known of its cache is void."""
        ...


Prefilling = Mapping[WorkerId, Sequence[Sequence[PageHash]]]
"""Per engine, the block hashes of the prompts it is prefilling (`EnginePool.prefilling`)."""


def with_prefilling(
    overlaps: Mapping[WorkerId, int],
    hashes: Sequence[PageHash],
    prefilling: Prefilling,
) -> dict[WorkerId, int]:
    """Each engine's overlap, counting the blocks of the prompts it is prefilling as held.

    The engine's events bring those blocks only once its prefill is done;
    a second request with the same new prefix meanwhile belongs beside the
    first (vLLM even shares the blocks of concurrent requests), not on
    another engine that would compute and cache it again.
    """
    out = dict(overlaps)
    for worker_id, prompts in prefilling.items():
        best = out.get(worker_id, 0)
        for other in prompts:
            n = 0
            for mine, theirs in zip(hashes, other, strict=False):
                if mine != theirs:
                    break
                n += 1
            best = max(best, n)
        if best:
            out[worker_id] = best
    return out


class BalancedPlacement:
    """Where a request that no engine holds a conversation of goes: the engine that has
    computed the fewest prompt blocks so far.

    Every prompt starts with blocks all conversations share (a system
    prompt); holding only those (at most `shared_prefix_blocks`) is no
    affinity, so such a request starts a conversation, or restarts one whose
    blocks were evicted everywhere. Placing it by the queues of the moment
    (`kv_aware`'s cost) leaves one engine with more conversations' blocks to
    keep than the other and it evicts sooner; placing it where fewer blocks
    were computed evens out what each engine's cache must hold, and with it
    the work (the offline replay of the benchmark's slice: 0.679 reuse
    against 0.624-0.625 by conversation counts, docs/engines.md). A
    request whose prefix an engine does hold is left to the policy.
    """

    def __init__(self, shared_prefix_blocks: int) -> None:
        if shared_prefix_blocks < 1:
            raise ConfigError(
                f"shared_prefix_blocks must be >= 1 to place conversations, got "
                f"{shared_prefix_blocks} (0 turns the placement off)"
            )
        self.shared_prefix_blocks = shared_prefix_blocks
        self.computed: dict[WorkerId, int] = {}
        """Per engine, the prompt blocks routed there that it was not counted to hold."""

    def places(self, overlaps: Mapping[WorkerId, int], loads: Sequence[WorkerLoad]) -> bool:
        """No candidate holds more of the prompt than the shared blocks."""
        held = (0 if load.stale else overlaps.get(load.worker_id, 0) for load in loads)
        return max(held, default=0) <= self.shared_prefix_blocks

    def choose(
        self,
        name: str,
        request: RouteRequest,
        overlaps: Mapping[WorkerId, int],
        loads: Sequence[WorkerLoad],
        rng: random.Random,
    ) -> RouteDecision:
        """The candidate (`candidates`' best rank) with the fewest computed blocks; ties by
        fewer queued prefill tokens, then at random. Its cost: its computed blocks."""
        cands = candidates(request, overlaps, loads)
        keys = [
            (self.computed.get(load.worker_id, 0), load.active_prefill_tokens)
            for load in cands.loads
        ]
        best = min(keys)
        tied = [i for i, k in enumerate(keys) if k == best]
        i = tied[0] if len(tied) == 1 else rng.choice(tied)
        return decide(name, request, cands, i, float(best[0]))

    def record(self, request: RouteRequest, decision: RouteDecision) -> None:
        engine = decision.worker_id
        computed = max(request.num_pages - decision.local_pages, 0)
        self.computed[engine] = self.computed.get(engine, 0) + computed

    def forget(self, worker_id: WorkerId) -> None:
        """A restarted engine's cache is empty: it takes new conversations first."""
        self.computed.pop(worker_id, None)


class IndexRouter:
    """A coordinator policy over `index` (fed elsewhere, by the engines' event subscribers).

    `shared_prefix_blocks` > 0: a request of which no engine holds more than
    that many leading blocks is placed by `BalancedPlacement`, the others by
    the policy.
    """

    def __init__(
        self,
        index: GlobalIndex,
        policy: str,
        config: CoordinatorConfig,
        shared_prefix_blocks: int = 0,
    ) -> None:
        if shared_prefix_blocks < 0:
            raise ConfigError(f"shared_prefix_blocks must be >= 0, got {shared_prefix_blocks}")
        self.index = index
        self.name = policy
        self._rng = random.Random(config.seed)
        self._policy: RoutingPolicy = make_policy(policy, config, self._rng)
        self.placement = BalancedPlacement(shared_prefix_blocks) if shared_prefix_blocks else None

    def route(
        self,
        request: RouteRequest,
        loads: Sequence[WorkerLoad],
        key: bytes,
        prefilling: Prefilling | None = None,
    ) -> RouteDecision:
        return self.choose(request, self.overlaps(request, prefilling), loads, key)

    def overlaps(
        self, request: RouteRequest, prefilling: Prefilling | None = None
    ) -> dict[WorkerId, int]:
        overlaps = self.index.match(request.hashes).pages
        if prefilling:
            return with_prefilling(overlaps, request.hashes, prefilling)
        return dict(overlaps)

    def choose(
        self,
        request: RouteRequest,
        overlaps: Mapping[WorkerId, int],
        loads: Sequence[WorkerLoad],
        key: bytes,
    ) -> RouteDecision:
        self._rng.seed(key)
        placement = self.placement
        if placement is None:
            return self._policy.choose(request, overlaps, loads)
        if placement.places(overlaps, loads):
            decision = placement.choose(self.name, request, overlaps, loads, self._rng)
        else:
            decision = self._policy.choose(request, overlaps, loads)
        placement.record(request, decision)
        return decision

    def stale(self) -> set[WorkerId]:
        return self.index.stale_workers()

    def forget(self, worker_id: WorkerId) -> None:
        """A restarted engine's events start a new incarnation; its placement count restarts."""
        if self.placement is not None:
            self.placement.forget(worker_id)


class MeshHeld(dict[WorkerId, int]):
    """Per engine, the leading blocks of a request it reuses without a pull (its own cache's
    and its store's); `from_store`: how many of them only its store holds (loaded from it)."""

    __slots__ = ("from_store",)

    def __init__(self, held: Mapping[WorkerId, int], from_store: Mapping[WorkerId, int]) -> None:
        super().__init__(held)
        self.from_store: dict[WorkerId, int] = dict(from_store)


class MeshRouter(IndexRouter):
    """``kv_mesh``: `kv_aware` over what each engine's own cache and its kvmesh store hold,
    with every request allowed to pull from the engine (cache or store) that holds more of
    its prefix (the engines' stores do the pull).

    `stores` maps an engine to the index worker its store's events feed
    (`kvmesh.gateway.config.store_worker_id`). An engine's store prefix counts
    beyond its own cache's (the connector asks its store for the blocks after
    the engine's own hit), in the host tier; a store whose stream is stale, or
    whose engine is, counts nothing.
    """

    def __init__(
        self,
        index: GlobalIndex,
        config: CoordinatorConfig,
        stores: Mapping[WorkerId, WorkerId] | None = None,
    ) -> None:
        super().__init__(index, "kv_aware", config)
        self.name = MESH_POLICY
        self.stores = dict(stores or {})
        self._store_ids = frozenset(self.stores.values())

    def overlaps(self, request: RouteRequest, prefilling: Prefilling | None = None) -> MeshHeld:
        """One index walk: each engine's own prefix (with the prompts it is prefilling), then
        its store's prefix beyond it."""
        match = self.index.match(request.hashes).pages
        own = {w: n for w, n in match.items() if w not in self._store_ids}
        if prefilling:
            own = with_prefilling(own, request.hashes, prefilling)
        from_store: dict[WorkerId, int] = {}
        if self.stores:
            stale = self.index.stale_workers()
            for engine, store in self.stores.items():
                stored = match.get(store, 0)
                beyond = stored - own.get(engine, 0)
                if beyond > 0 and store not in stale and engine not in stale:
                    own[engine] = stored
                    from_store[engine] = beyond
        return MeshHeld(own, from_store)

    def choose(
        self,
        request: RouteRequest,
        overlaps: Mapping[WorkerId, int],
        loads: Sequence[WorkerLoad],
        key: bytes,
    ) -> RouteDecision:
        """`overlaps` as `overlaps` returned them; a plain mapping counts as own caches only."""
        mesh_request = dataclasses.replace(request, allow_pull=True)
        from_store = overlaps.from_store if isinstance(overlaps, MeshHeld) else {}
        tiers = {
            engine: TierPages(gpu=overlaps[engine] - n, cpu=n) for engine, n in from_store.items()
        }
        self._rng.seed(key)
        decision = self._policy.choose(mesh_request, overlaps, loads, tiers or None)
        return dataclasses.replace(decision, policy=MESH_POLICY)


class HistoryRouter:
    """``approx_prefix``: `kv_aware` over the blocks this router sent to each engine.

    Each engine's history is an LRU of block hashes capped at
    `capacity_blocks` (0: unbounded); a request's blocks are touched last
    block first, so its first block is the most recent and a prefix's head
    outlives its tail, as in vLLM's own pool. Cost: O(request blocks) per
    decision plus the evictions it causes.
    """

    def __init__(
        self, config: CoordinatorConfig, capacity_blocks: int = 0, shared_prefix_blocks: int = 0
    ) -> None:
        if capacity_blocks < 0:
            raise ConfigError(f"history capacity must be >= 0 blocks, got {capacity_blocks}")
        self.name = HISTORY_POLICY
        self.capacity_blocks = capacity_blocks
        self.index = GlobalIndex()
        self._inner = IndexRouter(self.index, "kv_aware", config, shared_prefix_blocks)
        self._lru: dict[WorkerId, OrderedDict[PageHash, None]] = {}
        self._seq: dict[WorkerId, int] = {}

    def route(
        self,
        request: RouteRequest,
        loads: Sequence[WorkerLoad],
        key: bytes,
        prefilling: Prefilling | None = None,
    ) -> RouteDecision:
        """`prefilling` adds nothing here: the history records a decision when it is made."""
        return self.choose(request, self.overlaps(request), loads, key)

    def overlaps(
        self, request: RouteRequest, prefilling: Prefilling | None = None
    ) -> dict[WorkerId, int]:
        return self._inner.overlaps(request)

    def choose(
        self,
        request: RouteRequest,
        overlaps: Mapping[WorkerId, int],
        loads: Sequence[WorkerLoad],
        key: bytes,
    ) -> RouteDecision:
        decision = self._inner.choose(request, overlaps, loads, key)
        self._record(decision.worker_id, request.hashes)
        return decision

    def _record(self, worker_id: WorkerId, hashes: Sequence[PageHash]) -> None:
        if not hashes:
            return
        lru = self._lru.setdefault(worker_id, OrderedDict())
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        events: list[PagesStored | PagesRemoved] = [PagesStored(tuple(hashes), None, (), 1)]
        if self.capacity_blocks and len(lru) > self.capacity_blocks:
            evicted = [lru.popitem(last=False)[0] for _ in range(len(lru) - self.capacity_blocks)]
            events.append(PagesRemoved(tuple(evicted)))
        seq = self._seq.get(worker_id, -1) + 1
        self._seq[worker_id] = seq
        self.index.apply(make_batch(events, worker_id, "history", seq))

    def stale(self) -> set[WorkerId]:
        return set()

    def forget(self, worker_id: WorkerId) -> None:
        self.index.remove_worker(worker_id)
        self._inner.forget(worker_id)
        self._lru.pop(worker_id, None)
        self._seq.pop(worker_id, None)


POLICY_NAMES: tuple[str, ...] = (*sorted(REGISTRY), HISTORY_POLICY, MESH_POLICY)
"""Every name `--policy` accepts."""


def make_router(
    policy: str,
    index: GlobalIndex,
    config: CoordinatorConfig,
    history_blocks: int = 0,
    stores: Mapping[WorkerId, WorkerId] | None = None,
    shared_prefix_blocks: int = 0,
) -> Router:
    """The router for `policy`; `ConfigError` naming the known policies otherwise.
    `stores`: engine -> its store's index worker, which only ``kv_mesh`` reads;
    `shared_prefix_blocks`: `BalancedPlacement` for ``kv_aware`` and ``approx_prefix``."""
    if policy == HISTORY_POLICY:
        return HistoryRouter(config, history_blocks, shared_prefix_blocks)
    if policy == MESH_POLICY:
        return MeshRouter(index, config, stores)
    if policy not in REGISTRY:
        raise ConfigError(f"unknown routing policy {policy!r}; choose one of {list(POLICY_NAMES)}")
    if shared_prefix_blocks and policy != "kv_aware":
        raise ConfigError(
            f"shared_prefix_blocks places conversations for kv_aware and {HISTORY_POLICY}, "
            f"not {policy!r}: leave it 0"
        )
    return IndexRouter(index, policy, config, shared_prefix_blocks)
