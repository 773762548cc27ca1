"""`kvmesh bench tiers`: promoting a page from host memory or disk against recomputing it.

On the worker's tiny model (`ModelConfig`'s defaults, on its device), one run
measures, for a prompt of ``--pages`` full pages:

- ``recompute``: the model's chunked prefill of the prompt's tokens (what a
  miss costs; the serving engine's prefill, chunk by chunk);
- ``host``: `TieredCache.promote` of the prompt's pages from the host tier
  (pinned memory on a GPU) into the device pool: the copy and the bookkeeping;
- ``disk``: the same from the disk tier: read, header and checksum checks,
  delete, copy. With ``--cold`` (default) each page file is dropped from the
  OS page cache first (``posix_fadvise(DONTNEED)``), so the read comes from
  the device, not from memory;
- tenants: a quiet tenant's page hit ratio alone, and beside a neighbour
  flooding unique prompts with ``fair`` and with ``lru`` eviction (real pool
  and cache manager), each beside the alone figure;
- eviction cost: one allocation by a tenant above its share in a full pool
  whose oldest pages another tenant holds, ``fair`` against ``lru``.

Each figure is the median of ``--repeats`` runs, in ms per page, and the
ratios recompute / promotion are printed beside them (both sides from the
same run). Pages sit in the lower tier by being evicted from the device
pool, exactly as in serving; only the promotion is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvmesh.arguments import positive_int
from kvmesh.config import ModelConfig
from kvmesh.hashing import ExtraKeys, PageHasher, RequestHashes
from kvmesh.types import PageHash
from kvmesh.worker.cache_manager import KVCacheManager, Request
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.model import TinyTransformer
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.tenant_share import make_eviction
from kvmesh.worker.tiered_cache import TieredCache


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=positive_int, default=64, help="full pages per prompt")
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    parser.add_argument("--repeats", type=positive_int, default=7, help="runs per figure")
    parser.add_argument(
        "--warm", dest="cold", action="store_false", help="read disk pages from the OS page cache"
    )
    parser.add_argument("--disk-dir", default=None, help="disk tier folder (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _recompute_s(model: TinyTransformer, tokens: list[int]) -> float:
    kv = model.empty_kv(len(tokens))
    chunk = model.cfg.prefill_chunk_tokens
    _sync(model.device)
    t0 = time.perf_counter()
    for lo in range(0, len(tokens), chunk):
        model.prefill_into(kv, lo, tokens[lo : lo + chunk])
    _sync(model.device)
    return time.perf_counter() - t0


def _promote_s(
    model: TinyTransformer,
    hasher: PageHasher,
    tokens: list[int],
    tier: str,
    disk_dir: Path,
    cold: bool,
) -> float:
    """Seconds `promote` takes to bring the prompt's pages back from `tier`."""
    n = len(tokens) // hasher.page_size
    store = KVStore(
        n + 2,
        model.num_layers,
        model.num_kv_heads,
        model.head_dim,
        hasher.page_size,
        model.dtype,
        model.device,
    )
    pool = PagePool(n + 2, page_size=hasher.page_size)
    tiers = TieredCache(
        pool,
        store,
        host_pages=n if tier == "host" else 0,
        disk_dir=disk_dir if tier == "disk" else None,
        disk_bytes=(n + 1) * (store.page_nbytes + 4096),
        disk_fsync=False,
        disk_adopt=False,
    )
    manager = KVCacheManager(pool, hasher.page_size, tiers=tiers)
    request = Request("bench", RequestHashes(hasher, [*tokens, 0]))
    manager.allocate_slots(request, len(tokens) + 1)
    ids = [p.page_id for p in manager.get_pages("bench")]
    store.write_pages(ids, torch.randn((len(ids), *store.page_shape)).to(store.dtype))
    manager.free(request)
    evict = pool.get_new_pages(pool.get_num_free_pages())  # every cached page goes a tier down
    pool.free_pages(evict)
    if tier == "disk" and cold:
        for path in disk_dir.iterdir():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    _sync(model.device)
    t0 = time.perf_counter()
    promoted = tiers.promote(request.page_hashes, n)
    _sync(model.device)
    elapsed = time.perf_counter() - t0
    if promoted != n:
        raise RuntimeError(f"promoted {promoted} of {n} pages from {tier}")
    return elapsed


QUIET_PROMPTS, PROMPT_PAGES, FLOOD_PER_QUIET, TENANT_POOL_PAGES = 8, 16, 4, 512


def _quiet_hit_ratio(eviction: str, flood: bool, rounds: int) -> float:
    """The page hit ratio of a quiet tenant cycling through 8 prompts of 16 pages (a quarter
    of a 512-page pool), alone or beside a neighbour flooding 4 unique 16-page prompts per
    quiet request, on a real pool and cache manager with `eviction`."""
    hasher = PageHasher(16)
    pool = PagePool(TENANT_POOL_PAGES + 1, page_size=16, event_token_ids=False)
    TieredCache(pool, KVStore(TENANT_POOL_PAGES + 1, 1, 1, 1, 16), eviction=eviction)
    manager = KVCacheManager(pool, 16)
    rng = random.Random(1)

    def tokens() -> list[int]:
        return [rng.randrange(256) for _ in range(PROMPT_PAGES * 16 + 1)]

    def serve(rid: str, toks: list[int], salt: str) -> int:
        request = Request(rid, RequestHashes(hasher, toks, ExtraKeys(cache_salt=salt)))
        hit, n = manager.get_computed_pages(request)
        manager.allocate_slots(request, len(toks) - n, n, hit)
        manager.free(request)
        return len(hit)

    quiet = [tokens() for _ in range(QUIET_PROMPTS)]
    hits = asked = 0
    for r in range(rounds):
        for i, q in enumerate(quiet):
            got = serve(f"q{r}-{i}", q, "quiet")
            if r:  # after the first round
                hits, asked = hits + got, asked + PROMPT_PAGES
            for j in range(FLOOD_PER_QUIET if flood else 0):
                serve(f"n{r}-{i}-{j}", tokens(), "noisy")
    return hits / asked


ALLOC_POOL_PAGES, ALLOC_PROTECTED_PAGES, ALLOC_PAGES, ALLOC_ROUNDS = 16_384, 4_000, 8, 2_000


def _allocation_us(eviction: str) -> float:
    """Microseconds per 8-page allocation (with its caching and freeing) by a tenant above its
    share, in a full 16,384-page pool whose oldest 4,000 free pages are a quiet tenant's:
    under `fair` they are protected, under `lru` they go first (the baseline). CPU time of
    this process (one thread of pure Python), so other work on the machine does not count."""
    pool = PagePool(ALLOC_POOL_PAGES + 1, page_size=16, event_token_ids=False)
    if eviction != "lru":
        pool.eviction = make_eviction(eviction)

    def cache(tenant: str, n: int, tag: int) -> None:
        pages = pool.get_new_pages(n, tenant)
        keys = [PageHash(f"{tenant}-{tag}-{i}".encode()) for i in range(n)]
        pool.cache_full_pages(pages, keys, 0, n, (), None, tenant)
        pool.free_pages(reversed(pages))

    cache("quiet", ALLOC_PROTECTED_PAGES, 0)
    cache("flood", ALLOC_POOL_PAGES - ALLOC_PROTECTED_PAGES, 0)
    pool.take_events()
    t0 = time.process_time()
    for r in range(1, ALLOC_ROUNDS + 1):
        cache("flood", ALLOC_PAGES, r)
        if not r % 256:
            pool.take_events()
    return (time.process_time() - t0) / ALLOC_ROUNDS * 1e6


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark and return its figures (the `--json` object)."""
    model = TinyTransformer(ModelConfig())
    hasher = PageHasher(args.page_size)
    rng = random.Random(0)
    tokens = [rng.randrange(model.cfg.vocab_size) for _ in range(args.pages * args.page_size)]
    _recompute_s(model, tokens)  # warm the kernels and the allocator
    recompute = statistics.median(_recompute_s(model, tokens) for _ in range(args.repeats))
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-tiers-", dir=args.disk_dir) as tmp:
        promote: dict[str, float] = {}
        for tier in ("host", "disk"):
            runs = []
            for _ in range(args.repeats + 1):  # the first run warms up
                runs.append(_promote_s(model, hasher, tokens, tier, Path(tmp), args.cold))
            promote[tier] = statistics.median(runs[1:])
    per_page = 1e3 / args.pages
    out: dict[str, Any] = {
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "pages": args.pages,
        "page_size": args.page_size,
        "page_bytes": model.num_layers
        * 2
        * args.page_size
        * model.num_kv_heads
        * model.head_dim
        * model.dtype.itemsize,
        "disk_cold": args.cold,
        "recompute_ms_per_page": recompute * per_page,
        "host_promote_ms_per_page": promote["host"] * per_page,
        "disk_promote_ms_per_page": promote["disk"] * per_page,
    }
    out["host_vs_recompute"] = recompute / promote["host"]
    out["disk_vs_recompute"] = recompute / promote["disk"]
    rounds = max(3, args.repeats)
    alone = _quiet_hit_ratio("lru", False, rounds)
    out["quiet_hit_ratio_alone"] = alone
    for eviction in ("fair", "lru"):
        ratio = _quiet_hit_ratio(eviction, True, rounds)
        out[f"quiet_hit_ratio_flooded_{eviction}"] = ratio
        out[f"quiet_flooded_vs_alone_{eviction}"] = ratio / alone if alone else 0.0
    for eviction in ("lru", "fair"):
        out[f"allocation_us_{eviction}"] = statistics.median(
            _allocation_us(eviction) for _ in range(args.repeats)
        )
    out["allocation_fair_vs_lru"] = out["allocation_us_fair"] / out["allocation_us_lru"]
    return out


def run(args: argparse.Namespace) -> int:
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"tiny model on {result['device']} ({result['dtype']}), {result['pages']} pages of "
        f"{result['page_size']} tokens ({result['page_bytes']} bytes each), "
        f"median of {args.repeats}"
    )
    print(f"  recompute          {result['recompute_ms_per_page']:.4f} ms/page")
    print(
        f"  promote from host  {result['host_promote_ms_per_page']:.4f} ms/page  "
        f"({result['host_vs_recompute']:.1f}x faster than recomputing)"
    )
    cold = "cold" if result["disk_cold"] else "page cache"
    print(
        f"  promote from disk  {result['disk_promote_ms_per_page']:.4f} ms/page  "
        f"({result['disk_vs_recompute']:.1f}x faster than recomputing; {cold})"
    )
    print(
        f"a quiet tenant ({QUIET_PROMPTS} prompts of {PROMPT_PAGES} pages, a {TENANT_POOL_PAGES}"
        f"-page pool) beside a neighbour flooding {FLOOD_PER_QUIET} unique prompts per request"
    )
    print(f"  hit ratio alone            {result['quiet_hit_ratio_alone']:.3f}")
    for eviction in ("fair", "lru"):
        print(
            f"  hit ratio flooded, {eviction:<4}    "
            f"{result[f'quiet_hit_ratio_flooded_{eviction}']:.3f}  "
            f"({result[f'quiet_flooded_vs_alone_{eviction}']:.2f}x alone)"
        )
    print(
        f"an allocation of {ALLOC_PAGES} pages by a tenant above its share, in a full "
        f"{ALLOC_POOL_PAGES}-page pool whose oldest {ALLOC_PROTECTED_PAGES} pages are another's"
    )
    print(
        f"  lru {result['allocation_us_lru']:.1f} us, fair {result['allocation_us_fair']:.1f} us "
        f"({result['allocation_fair_vs_lru']:.2f}x lru)"
    )
    return 0
