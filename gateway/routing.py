"""Where a request goes: a coordinator policy over an index of engine blocks.

Two routers share one shape (`Router`):

- `IndexRouter`: the index is fed by the engines' own KV events (vLLM's
  ``--kv-events-config``), so it holds what the engines really cache. Any
  coordinator policy by name (`kv_aware`, `round_robin`, ...); `kv_aware`
  places by conversation (`ConversationPlacement`, placement
  ``conversations``) unless told ``cost`` (the policy's cost per request).
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
from collections import OrderedDict, deque
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
from kvmesh.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored, make_batch
from kvmesh.gateway.config import (
    CONVERSATIONS,
    COST,
    HISTORY_POLICY,
    MESH_POLICY,
    PLACEMENTS,
)
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
            best = max(best, common_prefix(hashes, other))
        if best:
            out[worker_id] = best
    return out


def parting_depth(hashes: Sequence[PageHash], prefilling: Prefilling) -> int:
    """The longest leading run `hashes` shares with a prompt being prefilled that both go on
    past in different blocks: where the two prompts part (0: none). Their blocks reach the
    index's `PrefixBranches` only once prefilled."""
    depth = 0
    for prompts in prefilling.values():
        for other in prompts:
            n = common_prefix(hashes, other)
            if depth < n < min(len(hashes), len(other)):
                depth = n
    return depth


def common_prefix(a: Sequence[PageHash], b: Sequence[PageHash]) -> int:
    """How many leading blocks `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Held(dict[WorkerId, int]):
    """Per engine, the leading blocks of a request it holds (`IndexRouter.overlaps`);
    `parts_at`: where the request parts from a prompt being prefilled (`parting_depth`)."""

    __slots__ = ("parts_at",)

    def __init__(self, held: Mapping[WorkerId, int], parts_at: int = 0) -> None:
        super().__init__(held)
        self.parts_at = parts_at


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


class EngineWork:
    """The blocks each engine stored lately: its share of the last blocks all engines stored,
    as many as their caches hold now (an `IndexObserver`, so it reads the engines' events).

    Counted from events, not from this gateway's decisions, so two gateways
    fed the same events agree, and an engine another gateway loads counts
    too. The window is the blocks the index holds (the engines' caches once
    full): what a cache still holds came in within it, so an engine that
    restarted (or was reset) catches up by at most a cache's worth of blocks
    and never takes every new conversation for long. Cost: O(1) a batch,
    amortized.
    """

    def __init__(self, index: GlobalIndex) -> None:
        self.index = index
        self._recent: deque[tuple[WorkerId, int]] = deque()
        self._blocks: dict[WorkerId, int] = {}
        self._total = 0
        index.add_observer(self)

    def blocks(self, worker_id: WorkerId) -> int:
        """Blocks `worker_id` stored within the window."""
        return self._blocks.get(worker_id, 0)

    def events_applied(self, worker_id: WorkerId, events: Sequence[KVEvent]) -> None:
        stored = sum(len(e.page_hashes) for e in events if isinstance(e, PagesStored))
        if any(isinstance(e, AllPagesCleared) for e in events):
            self.worker_dropped(worker_id)
        if not stored:
            return
        self._recent.append((worker_id, stored))
        self._blocks[worker_id] = self._blocks.get(worker_id, 0) + stored
        self._total += stored
        window = len(self.index)
        while self._recent and self._total - self._recent[0][1] >= window:
            old, n = self._recent.popleft()
            self._total -= n
            self._blocks[old] -= n

    def worker_dropped(self, worker_id: WorkerId) -> None:
        """Its cache is gone: what it stored no longer weighs on where conversations go."""
        if self._blocks.pop(worker_id, None) is None:
            return
        self._recent = deque((w, n) for w, n in self._recent if w != worker_id)
        self._total = sum(n for _, n in self._recent)


class PrefixBranches:
    """Blocks the engines' caches continue in several ways: where prompts part.

    A prefix cached with several different continuations is shared by several
    prompts (a system prompt, a template), not one conversation's history;
    holding it is no reason to send a new conversation to the engine. Kept
    from events (`IndexObserver`): a block's children are the blocks stored
    after it that some engine still holds. Memory: one entry per held block.
    """

    def __init__(self, index: GlobalIndex) -> None:
        self.index = index
        self._parent: dict[PageHash, PageHash] = {}
        self._children: dict[PageHash, int] = {}
        index.add_observer(self)

    def shared_depth(self, hashes: Sequence[PageHash], held: int) -> int:
        """The longest leading run of `hashes`, up to `held` blocks, ending at a block the
        caches continue in `PARTED_WAYS` or more ways (0: none). O(held)."""
        children = self._children
        for k in range(held, 0, -1):
            if children.get(hashes[k - 1], 0) >= PARTED_WAYS:
                return k
        return 0

    def events_applied(self, worker_id: WorkerId, events: Sequence[KVEvent]) -> None:
        for e in events:
            if isinstance(e, PagesStored):
                parent = e.parent_hash
                for h in e.page_hashes:
                    if parent is not None and h not in self._parent:
                        self._parent[h] = parent
                        self._children[parent] = self._children.get(parent, 0) + 1
                    parent = h
            elif isinstance(e, PagesRemoved):
                for h in e.page_hashes:
                    if h not in self.index:
                        self._unlink(h)
            else:
                self.worker_dropped(worker_id)

    def worker_dropped(self, worker_id: WorkerId) -> None:
        """Blocks no engine holds any more are no one's children. O(blocks known)."""
        for h in [h for h in self._parent if h not in self.index]:
            self._unlink(h)

    def _unlink(self, h: PageHash) -> None:
        parent = self._parent.pop(h, None)
        if parent is None:
            return
        n = self._children[parent] - 1
        if n:
            self._children[parent] = n
        else:
            del self._children[parent]


class ConversationPlacement:
    """``kv_aware``'s default rule: a conversation stays on the engine that holds it; a new one
    goes to the engine that stored the fewest blocks lately.

    - Blocks every candidate holds, or that end where prompts part (where the
      caches continue them in `PARTED_WAYS` ways, `PrefixBranches`, or where
      a prompt being prefilled goes on differently, `parting_depth`): a
      system prompt, a template, are no affinity. A request no engine holds
      more of starts a conversation (or restarts one evicted everywhere): it
      goes to the engine with the least of the blocks it stored lately, its
      queued prefill and the blocks it would compute for this request (all
      in blocks, `EngineWork`), so each cache takes an even share of what
      must be kept: balanced by work, not by request count. A queued block
      weighs `queue_weight` blocks (``placement_queue_weight``): above 1 the
      queue of the moment counts more, so a burst of new conversations is
      split, while with nothing queued the caches' shares decide as before.
    - Otherwise the engine holding the longest prefix keeps the request. It
      yields only to an idle engine (nothing queued) and only when its own
      queued prefill exceeds `MOVE_PRICE` times the blocks it holds beyond
      that engine: a move computes those blocks again, takes as much room in
      the idle engine's cache and leaves a dead copy in the holder's, so a
      queue of the moment must be worth several times the hit.

    No engine takes every new conversation: a prefix prompts part at is no
    affinity however few engines hold it, and an idle engine takes the
    request of a holder that is busy enough.
    """

    def __init__(self, index: GlobalIndex, queue_weight: float) -> None:
        self.work = EngineWork(index)
        self.branches = PrefixBranches(index)
        self.queue_weight = queue_weight

    def choose(
        self,
        name: str,
        request: RouteRequest,
        overlaps: Mapping[WorkerId, int],
        loads: Sequence[WorkerLoad],
        rng: random.Random,
    ) -> RouteDecision:
        """`overlaps` as `IndexRouter.overlaps` returns them (`Held`: with `parts_at`).
        The decision's cost: the blocks stored lately plus the queued and computed blocks (a
        new conversation), or the blocks held beyond the chosen engine's (a follow-up)."""
        cands = candidates(request, overlaps, loads)
        held = cands.overlaps
        best = max(held)
        parts_at = overlaps.parts_at if isinstance(overlaps, Held) else 0
        shared = max(min(held), parts_at, self.branches.shared_depth(request.hashes, best))
        size = request.page_size
        queued = [load.active_prefill_tokens for load in cands.loads]
        work = [
            self.work.blocks(load.worker_id) + self.queue_weight * q / size
            for load, q in zip(cands.loads, queued, strict=True)
        ]
        everyone = range(len(held))
        if best <= shared:
            keys = [work[i] + request.num_pages - held[i] for i in everyone]
            i = _least(keys, queued, rng)
            return decide(name, request, cands, i, keys[i])
        holders = [i for i in everyone if held[i] == best]
        i = holders[_least([work[j] for j in holders], [queued[j] for j in holders], rng)]
        idle = [j for j in everyone if queued[j] == 0 and held[j] < best]
        if idle:
            j = max(idle, key=lambda j: (held[j], -work[j]))
            if queued[i] > MOVE_PRICE * (best - held[j]) * size:
                i = j
        return decide(name, request, cands, i, float(best - held[i]))


MOVE_PRICE = 4
"""How many times the blocks it would compute again a holder's queue must exceed before its
request moves to an idle engine (`ConversationPlacement`; docs/engines.md has the simulation
that set it: 1 and 2 lose hit rate, 3 to 8 are level)."""

PARTED_WAYS = 3
"""Continuations cached after a block that make it a shared prefix (`PrefixBranches`): two
may be one conversation editing its last turn, three are different prompts."""


def _least(keys: Sequence[float], queued: Sequence[int], rng: random.Random) -> int:
    """Index of the smallest key; ties by fewer queued tokens, then at random."""
    lo = min(keys)
    tied = [i for i, k in enumerate(keys) if k <= lo + 1e-9]
    if len(tied) > 1:
        q = min(queued[i] for i in tied)
        tied = [i for i in tied if queued[i] == q]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


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
        placement: str = COST,
    ) -> None:
        if placement not in PLACEMENTS:
            raise ConfigError(f"unknown placement {placement!r}; choose one of {list(PLACEMENTS)}")
        if placement == CONVERSATIONS and policy != "kv_aware":
            raise ConfigError(
                f"placement {CONVERSATIONS!r} is kv_aware's rule, not {policy!r}'s: leave it "
                f"{COST!r}"
            )
        if shared_prefix_blocks < 0:
            raise ConfigError(f"shared_prefix_blocks must be >= 0, got {shared_prefix_blocks}")
        self.index = index
        self.name = policy
        self._rng = random.Random(config.seed)
        self._policy: RoutingPolicy = make_policy(policy, config, self._rng)
        self.placement = BalancedPlacement(shared_prefix_blocks) if shared_prefix_blocks else None
        self.conversations = (
            ConversationPlacement(index, config.placement_queue_weight)
            if placement == CONVERSATIONS and self.placement is None
            else None
        )

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
            held = with_prefilling(overlaps, request.hashes, prefilling)
            if self.conversations is not None:
                return Held(held, parting_depth(request.hashes, prefilling))
            return held
        return dict(overlaps)

    def choose(
        self,
        request: RouteRequest,
        overlaps: Mapping[WorkerId, int],
        loads: Sequence[WorkerLoad],
        key: bytes,
    ) -> RouteDecision:
        self._rng.seed(key)
        if self.conversations is not None:
            return self.conversations.choose(self.name, request, overlaps, loads, self._rng)
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
        self,
        config: CoordinatorConfig,
        capacity_blocks: int = 0,
        shared_prefix_blocks: int = 0,
        placement: str = COST,
    ) -> None:
        if capacity_blocks < 0:
            raise ConfigError(f"history capacity must be >= 0 blocks, got {capacity_blocks}")
        self.name = HISTORY_POLICY
        self.capacity_blocks = capacity_blocks
        self.index = GlobalIndex()
        self._inner = IndexRouter(self.index, "kv_aware", config, shared_prefix_blocks, placement)
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
    placement: str | None = None,
) -> Router:
    """The router for `policy`; `ConfigError` naming the known policies otherwise.
    `stores`: engine -> its store's index worker, which only ``kv_mesh`` reads;
    `shared_prefix_blocks`: `BalancedPlacement` for ``kv_aware`` and ``approx_prefix``;
    `placement` (`PLACEMENTS`): None is ``conversations`` for ``kv_aware``, else ``cost``."""
    if placement is None:
        placement = CONVERSATIONS if policy == "kv_aware" else COST
    if policy == HISTORY_POLICY:
        return HistoryRouter(config, history_blocks, shared_prefix_blocks, placement)
    if policy == MESH_POLICY:
        if placement != COST:
            raise ConfigError(f"{MESH_POLICY} places by its own cost: leave placement {COST!r}")
        return MeshRouter(index, config, stores)
    if policy not in REGISTRY:
        raise ConfigError(f"unknown routing policy {policy!r}; choose one of {list(POLICY_NAMES)}")
    if shared_prefix_blocks and policy != "kv_aware":
        raise ConfigError(
            f"shared_prefix_blocks places conversations for kv_aware and {HISTORY_POLICY}, "
            f"not {policy!r}: leave it 0"
        )
    return IndexRouter(index, policy, config, shared_prefix_blocks, placement)
