"""The trace slice `kvmesh bench engines` replays, and what caches of the engines' size reuse of it.

The bundled trace names no sessions: a conversation is found from its
blocks (`conversations`). Issue #13 states its setup as "250 requests of
>= 8-turn conversations, each trace block as 32 tokens"; the readings of
that sentence (`SLICES`) differ in which requests a too long prompt takes
out of the slice:

- ``fitting-requests`` (the default): the first `n` requests, in trace
  order, of conversations of >= `min_turns` turns, leaving out only the
  requests whose prompt does not fit the engines' context;
- ``fitting-conversations`` (this benchmark's slice before): the same, but a
  conversation with any prompt too long is left out whole;
- ``whole-conversations``: every turn of the first such conversations
  whose every prompt fits, in trace order, until `n` requests.

and in how long a prompt is (`prompt_tokens`): every trace block a full
block of `block_tokens` ids (``full_blocks``), or the trace's own length
scaled by ``block_tokens / 512``, so that a prompt's last block is partial as
it is in the trace (a trace block id names 512 tokens and ``input_length``
ends inside the last one; vLLM hashes and reuses only full blocks, and the
next turn never shares that partial block).

`cache_replays` replays a slice through LRU block pools the engines' size,
counting hits as vLLM does (full leading blocks, at least the last token
computed, in tokens), so a slice's reachable hit rates are known before any
engine starts: one infinite pool (the bound), round robin over the engines,
each conversation pinned to one engine (balanced by conversation count), and
one shared pool of both engines' blocks.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.errors import ConfigError
from kvmesh.trace import TRACE_BLOCK_TOKENS, TraceRequest


def conversations(reqs: Sequence[TraceRequest]) -> list[int]:
    """Each request's conversation: a turn extends an earlier turn's blocks.

    A request joins the conversation of the latest request sharing its
    longest leading run of at least two blocks (the first block alone is the
    service's common system prompt); otherwise it starts a new one.
    """
    owner: dict[tuple[int, ...], int] = {}
    out: list[int] = []
    fresh = 0
    for r in reqs:
        h = r.hash_ids
        conv = next((owner[h[:k]] for k in range(len(h) - 1, 1, -1) if h[:k] in owner), None)
        if conv is None:
            conv, fresh = fresh, fresh + 1
        out.append(conv)
        for k in range(2, len(h)):
            owner[h[:k]] = conv
    return out


Picked = list[tuple[int, TraceRequest]]
"""Requests in trace order, each with its conversation."""


@dataclass(frozen=True, slots=True)
class Candidates:
    """The requests of conversations of >= `min_turns` turns, in trace order, and what a
    reading needs to pick among them."""

    requests: Picked
    turns: Mapping[int, int]  # a conversation's turns in the whole trace
    longest: Mapping[int, int]  # its longest prompt, in blocks
    max_blocks: int  # the longest prompt the engines take


def _fitting_requests(c: Candidates, n: int) -> Picked:
    return [(k, r) for k, r in c.requests if len(r.hash_ids) <= c.max_blocks][:n]


def _fitting_conversations(c: Candidates, n: int) -> Picked:
    return [(k, r) for k, r in c.requests if c.longest[k] <= c.max_blocks][:n]


def _whole_conversations(c: Candidates, n: int) -> Picked:
    fitting = [(k, r) for k, r in c.requests if c.longest[k] <= c.max_blocks]
    chosen: set[int] = set()
    total = 0
    for k in dict.fromkeys(k for k, _ in fitting):
        if total >= n:
            break
        chosen.add(k)
        total += c.turns[k]
    return [(k, r) for k, r in fitting if k in chosen][:n]


READINGS: dict[str, Callable[[Candidates, int], Picked]] = {
    "fitting-requests": _fitting_requests,
    "fitting-conversations": _fitting_conversations,
    "whole-conversations": _whole_conversations,
}
SLICES = tuple(READINGS)


def trace_slice(
    reqs: Sequence[TraceRequest],
    n: int,
    min_turns: int,
    max_blocks: int,
    kind: str = "fitting-conversations",
) -> Picked:
    """`n` requests, in trace order, of conversations of >= `min_turns` turns, as `kind` reads
    it (see the module docstring); a prompt fits when it has at most `max_blocks` blocks.

    Trace order interleaves many conversations, as a chat service sees them.
    `ConfigError` when the trace holds fewer than `n` such requests.
    """
    reading = READINGS.get(kind)
    if reading is None:
        raise ConfigError(f"unknown slice {kind!r}; choose one of {', '.join(SLICES)}")
    conv_of = conversations(reqs)
    turns = Counter(conv_of)
    longest: dict[int, int] = {}
    for c, r in zip(conv_of, reqs, strict=True):
        longest[c] = max(longest.get(c, 0), len(r.hash_ids))
    requests = [(c, r) for c, r in zip(conv_of, reqs, strict=True) if turns[c] >= min_turns]
    picked = reading(Candidates(requests, turns, longest, max_blocks), n)
    if len(picked) < n:
        raise ConfigError(
            f"the trace has only {len(picked)} requests in conversations of >= {min_turns} "
            f"turns within {max_blocks} blocks ({kind}); ask for fewer --requests"
        )
    return picked


def prompt_tokens(r: TraceRequest, block_tokens: int, full_blocks: bool) -> int:
    """The prompt's length in token ids when each trace block is `block_tokens` ids: every
    block full, or the trace's `input_length` scaled (its last block partial, as in the trace)."""
    whole = len(r.hash_ids) * block_tokens
    if full_blocks:
        return whole
    scaled = -(-r.input_length * block_tokens // TRACE_BLOCK_TOKENS)  # ceil
    return max(1, min(whole, scaled))


@dataclass(frozen=True, slots=True)
class SlicePrompt:
    """What a cache replay needs of one request: its conversation, blocks and length."""

    conversation: int
    hash_ids: tuple[int, ...]
    tokens: int


def slice_prompts(picked: Picked, block_tokens: int, full_blocks: bool) -> list[SlicePrompt]:
    return [
        SlicePrompt(c, r.hash_ids, prompt_tokens(r, block_tokens, full_blocks)) for c, r in picked
    ]


class LRUBlockPool:
    """Cached blocks in eviction order, as vLLM's free queue keeps them for a finished request.

    A request touches its blocks last block first, so its first block is the
    most recent and a prefix's tail is evicted before its head. `capacity`
    0 is unbounded.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[tuple[int, ...], None] = OrderedDict()

    def serve(self, keys: Sequence[tuple[int, ...]]) -> int:
        """Caches `keys` (a prompt's full blocks, each named by its prefix) and returns how many
        leading ones were cached before."""
        hit = 0
        for k in keys:
            if k not in self._blocks:
                break
            hit += 1
        for k in reversed(keys):
            self._blocks[k] = None
            self._blocks.move_to_end(k)
        while self.capacity and len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        return hit


Assign = Callable[[int, SlicePrompt], int]
"""The request's index in the slice and the request -> the pool it goes to."""


def lru_hit_rate(
    prompts: Sequence[SlicePrompt], pools: Sequence[LRUBlockPool], assign: Assign, block_tokens: int
) -> float:
    """Prompt tokens served from cache over all prompt tokens, as vLLM's prefix-cache counters
    count them: full leading blocks, and never the whole prompt (its last token is computed)."""
    hits = queries = 0
    for i, p in enumerate(prompts):
        full = min(p.tokens // block_tokens, len(p.hash_ids))
        keys = [p.hash_ids[: k + 1] for k in range(full)]
        cached = pools[assign(i, p)].serve(keys) * block_tokens
        hits += min(cached, (p.tokens - 1) // block_tokens * block_tokens)
        queries += p.tokens
    return hits / queries if queries else 0.0


@dataclass(frozen=True, slots=True)
class CacheReplays:
    """A slice's hit rates (in tokens) through LRU pools of `engine_blocks` blocks per engine."""

    bound: float  # one infinite shared cache
    round_robin: float  # requests dealt to the engines in turn
    pinned: float  # each conversation on one engine, conversations balanced by count
    shared: float  # one pool of all engines' blocks


def pinned_by_count(engines: int) -> Assign:
    """Each new conversation to the engine with fewest conversations so far (ties: the lowest)."""
    engine_of: dict[int, int] = {}
    count = [0] * engines

    def assign(_: int, p: SlicePrompt) -> int:
        if p.conversation not in engine_of:
            e = count.index(min(count))
            engine_of[p.conversation] = e
            count[e] += 1
        return engine_of[p.conversation]

    return assign


def cache_replays(
    prompts: Sequence[SlicePrompt], block_tokens: int, engine_blocks: int, engines: int = 2
) -> CacheReplays:
    def pools(n: int, capacity: int) -> list[LRUBlockPool]:
        return [LRUBlockPool(capacity) for _ in range(n)]

    return CacheReplays(
        bound=lru_hit_rate(prompts, pools(1, 0), lambda i, p: 0, block_tokens),
        round_robin=lru_hit_rate(
            prompts, pools(engines, engine_blocks), lambda i, p: i % engines, block_tokens
        ),
        pinned=lru_hit_rate(
            prompts, pools(engines, engine_blocks), pinned_by_count(engines), block_tokens
        ),
        shared=lru_hit_rate(
            prompts, pools(1, engines * engine_blocks), lambda i, p: 0, block_tokens
        ),
    )


def slices_table(
    reqs: Sequence[TraceRequest],
    n: int,
    min_turns: int,
    max_blocks: int,
    block_tokens: int,
    engine_blocks: int,
) -> str:
    """Every reading of the slice (`SLICES`, full or partial last blocks) with its cache replays:
    what `kvmesh bench engines --slices` prints, without starting an engine."""
    lines = [
        f"{'slice':<24} {'last block':>10} {'req':>4} {'conv':>4} {'blocks':>6} "
        f"{'bound':>6} {'round robin':>11} {'pinned':>6} {'shared':>6}"
    ]
    for kind in SLICES:
        try:
            picked = trace_slice(reqs, n, min_turns, max_blocks, kind)
        except ConfigError as exc:
            lines.append(f"{kind:<24} {exc}")
            continue
        for full_blocks in (False, True):
            prompts = slice_prompts(picked, block_tokens, full_blocks)
            r = cache_replays(prompts, block_tokens, engine_blocks)
            blocks = sum(p.tokens for p in prompts) / len(prompts) / block_tokens
            lines.append(
                f"{kind:<24} {'full' if full_blocks else 'partial':>10} {len(picked):>4} "
                f"{len({c for c, _ in picked}):>4} {blocks:>6.1f} {r.bound:>6.3f} "
                f"{r.round_robin:>11.3f} {r.pinned:>6.3f} {r.shared:>6.3f}"
            )
    lines.append(
        f"hit rates in prompt tokens through LRU pools of {engine_blocks} blocks of "
        f"{block_tokens} tokens per engine (2 engines): bound = one infinite cache, pinned = "
        "each conversation on one engine, shared = one pool of both engines' blocks"
    )
    return "\n".join(lines)
