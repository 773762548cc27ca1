"""`kvmesh bench placement`: the gateway's routing in front of simulated engines, per policy.

What `kvmesh bench engines` measures on real vLLM engines, without them: the
slice of the trace (`engine_slices.trace_slice`, the same readings) goes
through the gateway's real routing code (`gateway.routing.make_router`, the
coordinator's `GlobalIndex`, `gateway.engines.EnginePool` for the in-flight
load and the prompts being prefilled, as `Gateway.route` uses them) to
simulated engines, in simulated time, deterministically:

- each engine is vLLM's prefix cache as routing sees it (`SimBlockPool`): a
  pool of `engine_blocks` blocks, cached blocks of finished requests in an
  LRU free queue (a request's blocks freed last block first, so a prefix's
  head outlives its tail), blocks of running requests pinned, only full
  blocks cached, at least the last prompt token computed. It publishes the
  KV events vLLM would (BlockRemoved when it evicts for a request it
  schedules, BlockStored when the prefill is done) as vLLM's msgpack
  payloads, which reach the index through the gateway's own decoder
  (`kvmesh.engine_events.decode_engine_payload`);
- each engine computes one prefill at a time, first come first served, at a
  fixed rate in tokens per ms plus a fixed cost per request (`EngineSpeed`);
  a request's first token ends its prefill, its last one comes `decode_ms`
  later (decode steps run beside the next prefill, as vLLM batches them), so
  load is real in simulated time: queues form, and the gateway sees them as
  in-flight prefill tokens;
- ``clients`` clients send the slice in trace order, each turn after its
  conversation's previous one was answered (the bench's closed replay), or
  (``--arrival trace``) each turn arrives at the trace's own time,
  compressed to ``--load`` times round robin's closed-loop rate simulated
  first, as ``bench engines --arrival trace`` sends them.

Per policy it prints the engines' prefix-cache hit rate (in prompt tokens, as
vLLM counts it), the prompt tokens computed (the work), the share of requests
each engine took and the simulated TTFT. The hit rates and the work are the
figures to compare; the simulated TTFT follows the assumed speed.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace

import msgpack

from kvmesh.arguments import non_negative_int, positive_float, positive_int
from kvmesh.benchmarks.bench_engines import ARRIVALS, DEFAULT_LOAD, Turn, send_times
from kvmesh.benchmarks.engine_slices import (
    SLICES,
    Picked,
    cache_replays,
    prompt_tokens,
    slice_prompts,
    trace_slice,
)
from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import RouteRequest
from kvmesh.engine_events import decode_engine_payload
from kvmesh.engine_hash import EngineHasher
from kvmesh.errors import ConfigError
from kvmesh.gateway.config import EngineTarget
from kvmesh.gateway.engines import EnginePool, Ticket
from kvmesh.gateway.routing import Router, make_router, tie_break_key
from kvmesh.stats import percentile
from kvmesh.trace import blocks_tokens, load_trace
from kvmesh.types import PageHash, WorkerId

POLICIES = (
    "kv_aware",
    "kv_aware[placement=cost]",
    "kv_aware[shared_prefix_blocks=1;queue_weight=0]",
    "approx_prefix",
    "round_robin",
)
ROUTER_SETTINGS = ("placement", "shared_prefix_blocks")
"""Settings of the gateway's router (not `CoordinatorConfig` fields) a policy label may set."""


@dataclass(frozen=True, slots=True)
class EngineSpeed:
    """How fast a simulated engine works (one pinned core of the bench's tiny model, roughly)."""

    prefill_tokens_per_ms: float = 4.0
    overhead_ms: float = 10.0  # per request: scheduling, the first token's step
    decode_ms: float = 16.0  # from the first token to the last

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_ms > 0:
            raise ConfigError(f"prefill rate must be positive, got {self.prefill_tokens_per_ms}")
        if self.overhead_ms < 0 or self.decode_ms < 0:
            raise ConfigError("overhead_ms and decode_ms must be >= 0")

    def prefill_ms(self, tokens: int) -> float:
        return self.overhead_ms + tokens / self.prefill_tokens_per_ms


@dataclass(frozen=True, slots=True)
class SimTurn:
    """One request of the slice: its conversation, token ids and full blocks' hashes."""

    conversation: int
    token_ids: tuple[int, ...]
    hashes: tuple[PageHash, ...]
    at_s: float = 0.0  # the trace's time, after the slice's first request


def sim_turns(picked: Picked, block_tokens: int, full_blocks: bool) -> list[SimTurn]:
    """The slice's prompts as the bench builds them (each trace block `block_tokens` ids, cut
    to `prompt_tokens`), hashed once as a vLLM engine with default settings hashes them."""
    table = blocks_tokens({b for _, r in picked for b in r.hash_ids}, block_tokens)
    hasher = EngineHasher(block_size=block_tokens)
    out: list[SimTurn] = []
    first = picked[0][1].timestamp_ms if picked else 0
    for conversation, r in picked:
        ids = tuple(t for b in r.hash_ids for t in table[b])
        ids = ids[: prompt_tokens(r, block_tokens, full_blocks)]
        at_s = (r.timestamp_ms - first) / 1000
        out.append(SimTurn(conversation, ids, tuple(hasher.hash_prompt(ids)), at_s))
    return out


@dataclass(slots=True)
class _Job:
    """One request on a simulated engine."""

    index: int
    turn: SimTurn
    ticket: Ticket
    sent_ms: float
    held: list[PageHash] = field(default_factory=list)  # cached blocks it references
    uncached: int = 0  # its blocks that hold no cached hash (partial, decode, duplicates)
    hit_blocks: int = 0


class SimBlockPool:
    """One engine's KV blocks as vLLM's block pool keeps them, publishing its events.

    Invariant: ``len(free) + len(used) + uncached <= capacity`` whenever the
    running requests fit (vLLM would not schedule one that does not; here it
    is scheduled anyway and the pool runs over until one finishes, when it evicts back
    down; the bench's slice, at most ~127 blocks a prompt beside 384, never needs it).
    """

    def __init__(self, capacity: int, block_tokens: int, publish: Callable[[list[dict]], None]):
        self.capacity = capacity
        self.block_tokens = block_tokens
        self.free: OrderedDict[PageHash, None] = OrderedDict()  # evicted from the front
        self.used: dict[PageHash, int] = {}  # cached blocks of running requests: references
        self.uncached = 0
        self.publish = publish

    def schedule(self, job: _Job, max_tokens: int) -> None:
        """The prefix hit (never the last prompt token), pins it and makes room for the rest."""
        hashes, size = job.turn.hashes, self.block_tokens
        cap = min(len(hashes), (len(job.turn.token_ids) - 1) // size)
        hit = 0
        while hit < cap and (hashes[hit] in self.free or hashes[hit] in self.used):
            hit += 1
        for h in hashes[:hit]:
            self.free.pop(h, None)
            self.used[h] = self.used.get(h, 0) + 1
        job.held = list(hashes[:hit])
        job.hit_blocks = hit
        need = -(-(len(job.turn.token_ids) + max_tokens) // size) - hit
        self._evict(need)
        self.uncached += need
        job.uncached = need

    def prefilled(self, job: _Job) -> None:
        """The prompt's full blocks beyond the hit are cached (a block cached meanwhile by
        another request stays this one's own, uncached copy, as in vLLM)."""
        events: list[dict] = []
        run: list[int] = []
        for k in range(job.hit_blocks, len(job.turn.hashes)):
            h = job.turn.hashes[k]
            if h in self.free or h in self.used:
                if run:
                    events.append(self._stored(job, run))
                    run = []
                continue
            self.used[h] = 1
            self.uncached -= 1
            job.uncached -= 1
            job.held.append(h)
            run.append(k)
        if run:
            events.append(self._stored(job, run))
        if events:
            self.publish(events)

    def _stored(self, job: _Job, run: list[int]) -> dict:
        size, hashes = self.block_tokens, job.turn.hashes
        first = run[0]
        return {
            "type": "BlockStored",
            "block_hashes": _ints([hashes[k] for k in run]),
            "parent_block_hash": _ints([hashes[first - 1]])[0] if first else None,
            "token_ids": list(job.turn.token_ids[first * size : (run[-1] + 1) * size]),
            "block_size": size,
        }

    def release(self, job: _Job) -> None:
        """The request finished: its cached blocks go to the free queue, last block first; a
        pool that ran over (requests scheduled together that did not fit) evicts back down to
        its capacity, so it never holds more than vLLM's would once they are done."""
        for h in reversed(job.held):
            n = self.used[h] - 1
            if n:
                self.used[h] = n
            else:
                del self.used[h]
                self.free[h] = None
        self.uncached -= job.uncached
        self._evict(0)

    def _evict(self, need: int) -> None:
        """Free blocks out, oldest first, until `need` more fit (or none is left to evict)."""
        evicted: list[PageHash] = []
        while self.free and len(self.free) + len(self.used) + self.uncached + need > self.capacity:
            evicted.append(self.free.popitem(last=False)[0])
        if evicted:
            self.publish([{"type": "BlockRemoved", "block_hashes": _ints(evicted)}])


def _ints(hashes: Sequence[PageHash]) -> list[int]:
    """Block hashes as vLLM's events carry them by default: unsigned 64-bit ints."""
    return [int.from_bytes(h, "big") for h in hashes]


class SimEngine:
    """A simulated engine: its block pool, its prefill queue, its events into `index`."""

    def __init__(self, name: str, capacity: int, block_tokens: int, index: GlobalIndex) -> None:
        self.worker_id = WorkerId(name)
        self.index = index
        self.seq = -1
        self.now = 0.0
        self.pool = SimBlockPool(capacity, block_tokens, self._publish)
        self.queue: deque[_Job] = deque()
        self.busy = False
        self.requests = 0

    def _publish(self, events: list[dict]) -> None:
        """One KV event batch, encoded as vLLM encodes it and decoded as the gateway does."""
        self.seq += 1
        payload = msgpack.packb([self.now / 1000, events, 0])
        batch = decode_engine_payload(payload).to_event_batch(self.worker_id, "sim", self.seq)
        self.index.apply(batch)


@dataclass(slots=True)
class SimResult:
    """One policy's replay in simulated time."""

    policy: str
    requests: int
    engine_prefix_hit_rate: float
    computed_tokens: int
    engine_requests: dict[str, int]
    ttft_mean_ms: float
    ttft_p99_ms: float
    moved: int  # follow-ups sent to another engine than their conversation's previous turn
    follow_ups: int
    requests_per_s: float  # answered per simulated second

    @property
    def max_share(self) -> float:
        return max(self.engine_requests.values()) / self.requests if self.requests else 0.0


class Simulation:
    """`turns` through `router` to `engines` simulated engines, `clients` clients, closed."""

    def __init__(
        self,
        turns: Sequence[SimTurn],
        router: Router,
        index: GlobalIndex,
        *,
        engines: int = 2,
        engine_blocks: int = 384,
        block_tokens: int = 32,
        clients: int = 4,
        max_tokens: int = 4,
        speed: EngineSpeed | None = None,
    ) -> None:
        if engines < 1 or clients < 1 or engine_blocks < 1:
            raise ConfigError("a simulation needs at least one engine, one client, one block")
        self.turns = list(turns)
        self.router = router
        self.block_tokens = block_tokens
        self.clients = clients
        self.max_tokens = max_tokens
        self.speed = speed or EngineSpeed()
        names = [f"engine-{i}" for i in range(engines)]
        self.pool = EnginePool(EngineTarget(n, f"http://sim-{n}") for n in names)
        self.engines = {
            WorkerId(n): SimEngine(n, engine_blocks, block_tokens, index) for n in names
        }
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._order = 0
        self.ttfts: list[float] = []
        self.hits = self.queries = self.computed = 0
        self._engine_of: dict[int, WorkerId] = {}
        self.moved = self.follow_ups = 0
        self.last_ms = 0.0

    def _at(self, t: float, action: Callable[[float], None]) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, self._order, action))

    def run(self, label: str, rate: float | None = None) -> SimResult:
        """Closed (`clients` clients), or open with `rate`: the trace's arrivals compressed to
        `rate` requests per simulated second (`bench_engines.send_times`), a turn sent at its
        arrival or when its conversation's previous turn is answered, if later."""
        todo = deque(range(len(self.turns)))
        previous: dict[int, int] = {}
        before: list[int | None] = []
        for i, turn in enumerate(self.turns):
            before.append(previous.get(turn.conversation))
            previous[turn.conversation] = i
        done: set[int] = set()
        waiting: dict[int, list[int]] = {}

        def next_turn(t: float) -> None:
            if not todo:
                return
            i = todo.popleft()
            p = before[i]
            if p is None or p in done:
                self._send(t, i, finished)
            else:
                waiting.setdefault(p, []).append(i)

        def finished(t: float, i: int) -> None:
            done.add(i)
            for j in waiting.pop(i, []):
                self._send(t, j, finished)
            if rate is None:
                next_turn(t)

        def arrive(i: int) -> Callable[[float], None]:
            def send(t: float) -> None:
                p = before[i]
                if p is None or p in done:
                    self._send(t, i, finished)
                else:
                    waiting.setdefault(p, []).append(i)

            return send

        if rate is None:
            for _ in range(self.clients):
                next_turn(0.0)
        else:
            stamps = [Turn(t.conversation, (), t.at_s) for t in self.turns]
            for i, at_s in enumerate(send_times(stamps, rate)):
                self._at(at_s * 1000, arrive(i))
        while self._heap:
            t, _, action = heapq.heappop(self._heap)
            action(t)
        n = len(self.turns)
        return SimResult(
            label,
            n,
            self.hits / self.queries if self.queries else 0.0,
            self.computed,
            {e: s.requests for e, s in self.engines.items()},
            sum(self.ttfts) / len(self.ttfts) if self.ttfts else 0.0,
            percentile(self.ttfts, 99) if self.ttfts else 0.0,
            self.moved,
            self.follow_ups,
            n / (self.last_ms / 1000) if self.last_ms else 0.0,
        )

    def _send(self, t: float, i: int, finished: Callable[[float, int], None]) -> None:
        """Route as `Gateway.route` does: the engines up, the prompts they prefill, the index."""
        turn = self.turns[i]
        loads = self.pool.loads(self.router.stale())
        request = RouteRequest(turn.hashes, len(turn.token_ids), page_size=self.block_tokens)
        key = tie_break_key(turn.hashes, turn.token_ids)
        overlaps = self.router.overlaps(request, self.pool.prefilling())
        decision = self.router.choose(request, overlaps, loads, key)
        state = self.pool[decision.worker_id]
        prefill = max(len(turn.token_ids) - decision.local_pages * self.block_tokens, 0)
        ticket = self.pool.begin(state, prefill, turn.hashes)
        engine = self.engines[decision.worker_id]
        engine.requests += 1
        last = self._engine_of.get(turn.conversation)
        if last is not None:
            self.follow_ups += 1
            self.moved += last != engine.worker_id
        self._engine_of[turn.conversation] = engine.worker_id
        job = _Job(i, turn, ticket, t)
        engine.queue.append(job)
        if not engine.busy:
            self._start(t, engine, finished)

    def _start(self, t: float, engine: SimEngine, finished: Callable[[float, int], None]) -> None:
        job = engine.queue.popleft()
        engine.busy = True
        engine.now = t
        engine.pool.schedule(job, self.max_tokens)
        tokens = len(job.turn.token_ids)
        computed = tokens - job.hit_blocks * self.block_tokens
        self.hits += tokens - computed
        self.queries += tokens
        self.computed += computed

        def prefill_done(t: float) -> None:
            engine.now = t
            engine.pool.prefilled(job)
            job.ticket.prefill_done()
            self.ttfts.append(t - job.sent_ms)
            engine.busy = False
            if engine.queue:
                self._start(t, engine, finished)

            def complete(t: float) -> None:
                engine.now = t
                engine.pool.release(job)
                job.ticket.close()
                finished(t, job.index)

            self._at(t + self.speed.decode_ms, complete)
            self.last_ms = max(self.last_ms, t + self.speed.decode_ms)

        self._at(t + self.speed.prefill_ms(computed), prefill_done)


def policy_router(label: str, index: GlobalIndex, engine_blocks: int) -> Router:
    """``NAME[field=value;...]`` -> the gateway's router for it: `CoordinatorConfig` fields and
    the router's settings (`ROUTER_SETTINGS`), as ``kvmesh bench engines --policies`` reads them."""
    name, bracket, rest = label.partition("[")
    config = CoordinatorConfig()
    settings: dict[str, str] = {}
    if bracket:
        if not rest.endswith("]"):
            raise ConfigError(f"policy {label!r}: write NAME[field=value;...]")
        known = {f.name: f for f in fields(CoordinatorConfig)}
        for item in rest[:-1].split(";"):
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or not key:
                raise ConfigError(f"policy {label!r}: {item!r} is not field=value")
            if key in ROUTER_SETTINGS:
                settings[key] = value
            elif key in known:
                kind = type(getattr(config, key))
                try:
                    config = replace(config, **{key: kind(value)})
                except ValueError as exc:
                    raise ConfigError(f"policy {label!r}: {key}={value!r}: {exc}") from exc
            else:
                raise ConfigError(
                    f"policy {label!r}: {key!r} is no CoordinatorConfig field (queue_weight, "
                    f"max_load_ratio, ...) nor a router setting ({', '.join(ROUTER_SETTINGS)})"
                )
    try:
        shared = int(settings.get("shared_prefix_blocks", "0"))
    except ValueError as exc:
        raise ConfigError(f"policy {label!r}: shared_prefix_blocks must be an int") from exc
    return make_router(
        name,
        index,
        config,
        history_blocks=engine_blocks,
        shared_prefix_blocks=shared,
        placement=settings.get("placement"),
    )


def simulate(
    turns: Sequence[SimTurn],
    label: str,
    *,
    engines: int = 2,
    engine_blocks: int = 384,
    block_tokens: int = 32,
    clients: int = 4,
    max_tokens: int = 4,
    speed: EngineSpeed | None = None,
    rate: float | None = None,
) -> SimResult:
    """One policy over a fresh index and fresh engines; `rate`: open loop (`Simulation.run`)."""
    index = GlobalIndex()
    router = policy_router(label, index, engine_blocks)
    sim = Simulation(
        turns, router, index, engines=engines, engine_blocks=engine_blocks,
        block_tokens=block_tokens, clients=clients, max_tokens=max_tokens, speed=speed,
    )  # fmt: skip
    return sim.run(label, rate)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=positive_int, default=250, help="requests in the slice")
    parser.add_argument("--min-turns", type=non_negative_int, default=8)
    parser.add_argument("--slice", choices=SLICES, default=SLICES[0], help="as bench engines")
    parser.add_argument("--full-blocks", action="store_true", help="as bench engines")
    parser.add_argument(
        "--concurrency", type=positive_int, default=4, help="clients of the closed loop"
    )
    parser.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default=ARRIVALS[0],
        help="closed: each client sends its next turn when its last is answered; trace: the "
        "trace's arrivals compressed to --load x round robin's closed-loop rate (open loop)",
    )
    parser.add_argument(
        "--load",
        type=positive_float,
        default=DEFAULT_LOAD,
        help="with --arrival trace: the arrival rate as a fraction of what round robin answers "
        "in the closed loop, simulated first",
    )
    parser.add_argument("--max-tokens", type=positive_int, default=4)
    parser.add_argument("--block-tokens", type=positive_int, default=32)
    parser.add_argument("--engine-blocks", type=positive_int, default=384)
    parser.add_argument("--engines", type=positive_int, default=2)
    parser.add_argument("--max-model-len", type=positive_int, default=4096)
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated; NAME[field=value;...] sets CoordinatorConfig fields or the "
        "router's placement / shared_prefix_blocks (kv_aware[placement=cost]: the rule before)",
    )
    parser.add_argument(
        "--prefill-tokens-per-ms",
        type=positive_float,
        default=4.0,
        help="the simulated engines' prefill speed",
    )
    parser.add_argument("--trace", default=None, help="trace file (default: the bundled one)")
    parser.add_argument("--json", action="store_true", help="one JSON object per policy")


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError("--policies names no policy")
    for label in policies:
        policy_router(label, GlobalIndex(), args.engine_blocks)  # refused before any replay
    max_blocks = (args.max_model_len - args.max_tokens) // args.block_tokens
    picked = trace_slice(
        load_trace(args.trace), args.requests, args.min_turns, max_blocks, args.slice
    )
    turns = sim_turns(picked, args.block_tokens, args.full_blocks)
    speed = EngineSpeed(prefill_tokens_per_ms=args.prefill_tokens_per_ms)
    shape = {
        "engines": args.engines,
        "engine_blocks": args.engine_blocks,
        "block_tokens": args.block_tokens,
        "clients": args.concurrency,
        "max_tokens": args.max_tokens,
    }
    rate = None
    if args.arrival == "trace":
        closed = simulate(turns, "round_robin", speed=speed, **shape)
        rate = args.load * closed.requests_per_s
    results = [simulate(turns, label, speed=speed, rate=rate, **shape) for label in policies]
    if args.json:
        for r in results:
            print(json.dumps({**asdict(r), "max_share": r.max_share}))
        return 0
    replays = cache_replays(
        slice_prompts(picked, args.block_tokens, args.full_blocks),
        args.block_tokens,
        args.engine_blocks,
        args.engines,
    )
    print(
        f"slice {args.slice} ({'full' if args.full_blocks else 'partial'} last blocks), "
        f"{len(turns)} requests, "
        + (f"{args.concurrency} clients" if rate is None else f"open loop at {rate:.2f}/s")
        + f", {args.engines} simulated engines "
        f"of {args.engine_blocks} blocks; LRU replays: bound {replays.bound:.3f}, round robin "
        f"{replays.round_robin:.3f}, pinned {replays.pinned:.3f}, shared {replays.shared:.3f}"
    )
    print(
        f"{'policy':<48} {'hit':>6} {'computed':>9} {'max share':>9} {'moved':>9} "
        f"{'TTFT mean':>9} {'p99':>7}"
    )
    for r in results:
        print(
            f"{r.policy:<48} {r.engine_prefix_hit_rate:>6.3f} {r.computed_tokens:>9} "
            f"{r.max_share:>9.2f} {r.moved:>4}/{r.follow_ups:<4} {r.ttft_mean_ms:>9.1f} "
            f"{r.ttft_p99_ms:>7.1f}"
        )
    base = {r.policy: r for r in results}
    kv = base.get("kv_aware")
    if kv is not None and kv.computed_tokens:
        for other in ("approx_prefix", "round_robin"):
            if other in base:
                ratio = base[other].computed_tokens / kv.computed_tokens
                print(f"prompt tokens computed, {other} / kv_aware = {ratio:.2f}x")
    print(
        f"simulated engines: one prefill at a time, {speed.prefill_tokens_per_ms:g} tokens/ms "
        f"+ {speed.overhead_ms:g} ms a request; TTFT in simulated ms follows that assumption"
    )
    return 0
