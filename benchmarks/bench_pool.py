"""`kvmesh bench pool`: trace replay through the page pool and cache manager.

Replays a Mooncake trace through ONE `KVCacheManager` over a `PagePool` of
``--pages`` pages of 512 tokens (one trace block = one page): per request
`get_computed_pages`, `allocate_slots` for the rest of the prompt (which
caches its full pages and emits the KV events), `free` (tail first), and
`take_events` to drain the events. A block id maps to fixed tokens
(`kvmesh.trace.block_tokens`), so equal blocks give equal chained hashes.

Timed: exactly those calls. Not timed: building the tokens and the page
hashes (hashing is measured on its own, below). Requests are prepared and
replayed `CHUNK` at a time, so a request's tokens were just hashed when the
pool sees them (as in an engine) and the trace's tokens never all sit in
memory. The same chunks go through the naive baseline (`naive_pool.py`),
which keeps the same policy, so both reach the same hit ratio.

Two modes, each with its own pool and baseline: events that carry the stored
pages' token ids (the pool's default; ``page_ops_per_s``) and hash-only
events (``*_hash_only_events``). Copying 512 token ids per stored page costs
more than the rest of that page's bookkeeping, so both are reported.

``page_ops_per_s`` = (page lookups + page allocations + page frees) / replay
seconds, where a lookup is one probe of the hash map (every hit, plus the
miss that ends the prefix). Seconds are the process's CPU time
(`time.process_time`), i.e. time on one core: on a shared machine wall time
also counts the time other processes held the core. The replay is single
threaded, so on an idle machine both agree.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.arguments import positive_int
from kvmesh.trace import TRACE_BLOCK_TOKENS, TraceRequest, blocks_tokens

DEFAULT_PAGES = 16384
CHUNK = 8
VOCAB_SIZE = 32000


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", default=None, help="Mooncake JSONL trace (.gz ok); default: the bundled one"
    )
    parser.add_argument(
        "--pages", type=positive_int, default=DEFAULT_PAGES, help="pool size in pages (page 0 is null)"
    )
    parser.add_argument(
        "--limit", type=positive_int, default=None, help="replay only the first N requests"
    )
    parser.add_argument(
        "--hash-pages", type=positive_int, default=4000, help="pages hashed for the hashing speed figures"
    )
    parser.add_argument("--seed", default="bench", help="cluster seed of the page hashes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(slots=True)
class _Replay:
    """Counts of one replay (pool or baseline)."""

    seconds: float = 0.0
    requests: int = 0
    rejected: int = 0
    pages: int = 0
    hit_pages: int = 0
    lookups: int = 0
    allocations: int = 0
    frees: int = 0
    events: int = 0

    @property
    def page_ops(self) -> int:
        return self.lookups + self.allocations + self.frees

    @property
    def ops_per_s(self) -> float:
        return self.page_ops / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class _Prepared:
    """One trace request ready to replay: the manager's `Request` and its block count."""

    request: Any
    blocks: int


def _chunks(reqs: Sequence[TraceRequest], hasher: Any, page_size: int) -> Iterator[list[_Prepared]]:
    """Requests with tokens and page hashes, `CHUNK` at a time (not timed)."""
    from kvmesh.hashing import RequestHashes
    from kvmesh.worker.cache_manager import Request

    for start in range(0, len(reqs), CHUNK):
        part = reqs[start : start + CHUNK]
        blocks = blocks_tokens([b for r in part for b in r.hash_ids], page_size, VOCAB_SIZE)
        out = []
        for n, r in enumerate(part, start):
            tokens: list[int] = []
            for b in r.hash_ids:
                tokens.extend(blocks[b])
            del tokens[max(r.input_length, 0) :]
            if tokens:
                rh = RequestHashes(hasher, tokens)
                out.append(_Prepared(Request(f"req-{n}", rh), len(r.hash_ids)))
        yield out


def _replay_pool(chunk: list[_Prepared], mgr: Any, stats: _Replay, page_size: int) -> None:
    """Timed replay of prepared requests through the real cache manager."""
    from time import process_time

    requests = [p.request for p in chunk]
    get_computed = mgr.get_computed_pages
    allocate = mgr.allocate_slots
    free = mgr.free
    take_events = mgr.take_events
    hits: list[int] = []
    push = hits.append
    n_events = 0
    t0 = process_time()
    for req in requests:
        pages, n = get_computed(req)
        if allocate(req, req.num_tokens - n, n, pages) is None:
            push(-1)
            continue
        push(len(pages))
        free(req)
        n_events += len(take_events())
    stats.seconds += process_time() - t0
    stats.events += n_events
    _count(chunk, hits, stats, page_size)


def _replay_naive(chunk: list[_Prepared], naive: Any, stats: _Replay, page_size: int) -> None:
    from time import process_time

    requests = [p.request for p in chunk]
    hits: list[int] = []
    push = hits.append
    n_events = 0
    t0 = process_time()
    for req in requests:
        rid, hashes, tokens = req.request_id, req.hashes.hashes, req.hashes.token_ids
        hit = naive.get_computed_pages(hashes, len(tokens))
        if naive.allocate(rid, hit, hashes, tokens) is None:
            push(-1)
            continue
        push(len(hit))
        naive.free(rid)
        n_events += len(naive.take_events())
    stats.seconds += process_time() - t0
    stats.events += n_events
    _count(chunk, hits, stats, page_size)


def _count(chunk: list[_Prepared], hits: list[int], stats: _Replay, page_size: int) -> None:
    for p, h in zip(chunk, hits, strict=True):
        num_tokens = p.request.num_tokens
        stats.requests += 1
        stats.pages += p.blocks
        if h < 0:
            stats.rejected += 1
            continue
        total = -(-num_tokens // page_size)
        max_pages = min((num_tokens - 1) // page_size, len(p.request.page_hashes))
        stats.hit_pages += h
        stats.lookups += h + (1 if h < max_pages else 0)
        stats.allocations += total - h
        stats.frees += total


def _hash_speed(algo: str, n_pages: int, page_size: int) -> float:
    """Tokens/s of chained page hashing, canonical encoding included (best of 3).

    Runs `PageHasher.hash_prompt`, the path `RequestHashes` takes, over
    `n_pages` full pages of trace tokens.
    """
    from kvmesh.hashing import PageHasher

    hasher = PageHasher(page_size, "bench", algo)
    blocks = blocks_tokens(range(n_pages), page_size, VOCAB_SIZE)
    tokens = [t for b in range(n_pages) for t in blocks[b]]
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        hashes = hasher.hash_prompt(tokens)
        best = min(best, time.process_time() - t0)
    if len(hashes) != n_pages:
        raise RuntimeError(f"hashed {len(hashes)} pages, expected {n_pages}")
    return n_pages * page_size / best


MODES: dict[str, bool] = {"": True, "_hash_only_events": False}
"""Result-key suffix -> whether `PagesStored` carries token ids (the pool's default: yes)."""


def measure(
    trace: str | None,
    num_pages: int,
    limit: int | None = None,
    hash_pages: int = 4000,
    seed: str = "bench",
) -> dict[str, Any]:
    """Run the whole benchmark and return its figures (the `--json` object).

    Two modes, each pool and baseline on the same requests: events with the
    pages' token ids (the pool's default), and hash-only events.
    """
    from kvmesh.benchmarks.naive_pool import NaivePrefixCache
    from kvmesh.hashing import PageHasher
    from kvmesh.trace import infinite_cache_hit_ratio, load_trace
    from kvmesh.worker.cache_manager import KVCacheManager
    from kvmesh.worker.page_pool import PagePool

    page_size = TRACE_BLOCK_TOKENS
    reqs = load_trace(trace, limit)
    hasher = PageHasher(page_size, seed, "sha256")
    runs = []
    for suffix, tokens in MODES.items():
        pool = PagePool(num_pages, page_size=page_size, event_token_ids=tokens)
        naive = NaivePrefixCache(num_pages, page_size, event_token_ids=tokens)
        runs.append((suffix, pool, KVCacheManager(pool, page_size), naive, _Replay(), _Replay()))
    for chunk in _chunks(reqs, hasher, page_size):
        for _, _, mgr, naive, ours, base in runs:
            _replay_pool(chunk, mgr, ours, page_size)
            _replay_naive(chunk, naive, base, page_size)
    result: dict[str, Any] = {"pages": num_pages, "page_size": page_size}
    for suffix, pool, mgr, _, ours, base in runs:
        if ours.page_ops == 0 or base.page_ops == 0:
            raise RuntimeError("the replay did no page operations")
        pool.check_invariants()
        result.update(
            {
                "page_hit_ratio" + suffix: ours.hit_pages / ours.pages,
                "baseline_page_hit_ratio" + suffix: base.hit_pages / base.pages,
                "events" + suffix: ours.events,
                "replay_s" + suffix: ours.seconds,
                "page_ops_per_s" + suffix: ours.ops_per_s,
                "baseline_replay_s" + suffix: base.seconds,
                "baseline_page_ops_per_s" + suffix: base.ops_per_s,
                "speedup_vs_baseline" + suffix: ours.ops_per_s / base.ops_per_s,
            }
        )
        if not suffix:
            result.update(
                {
                    "requests": ours.requests,
                    "rejected": ours.rejected,
                    "token_hit_ratio": mgr.stats.hit_ratio,
                    "page_ops": ours.page_ops,
                    "lookups": ours.lookups,
                    "allocations": ours.allocations,
                    "frees": ours.frees,
                }
            )
    result["bound_hit_ratio"] = infinite_cache_hit_ratio(reqs)
    result["sha256_tokens_per_s"] = _hash_speed("sha256", hash_pages, page_size)
    result["xxh3_tokens_per_s"] = _hash_speed("xxh3_128", hash_pages, page_size)
    return result


def run(args: argparse.Namespace) -> int:
    result = measure(args.trace, args.pages, args.limit, args.hash_pages, args.seed)
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"kvmesh bench pool: {result['pages']} pages of {result['page_size']} tokens",
        caption="rates per CPU-second of one core (time.process_time)",
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("requests", f"{result['requests']:,}"),
        ("page_hit_ratio", f"{result['page_hit_ratio']:.4f}"),
        ("baseline_page_hit_ratio", f"{result['baseline_page_hit_ratio']:.4f}"),
        ("bound_hit_ratio (infinite cache)", f"{result['bound_hit_ratio']:.4f}"),
        ("page ops (lookups + allocs + frees)", f"{result['page_ops']:,}"),
        ("KV events", f"{result['events']:,}"),
    ]
    for suffix, label in (("", "events with token ids"), ("_hash_only_events", "hash-only events")):
        rows += [
            (f"page_ops_per_s ({label})", f"{result['page_ops_per_s' + suffix]:,.0f}"),
            (
                f"baseline_page_ops_per_s ({label})",
                f"{result['baseline_page_ops_per_s' + suffix]:,.0f}",
            ),
            (
                f"speedup vs naive baseline ({label})",
                f"{result['speedup_vs_baseline' + suffix]:.2f}x",
            ),
        ]
    rows += [
        ("sha256_tokens_per_s", f"{result['sha256_tokens_per_s']:,.0f}"),
        ("xxh3_tokens_per_s", f"{result['xxh3_tokens_per_s']:,.0f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
    return 0
