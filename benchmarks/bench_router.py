"""`kvmesh bench router`: route decision latency, event ingestion rate, index ops, index memory.

Workload (synthetic, deterministic): ``--workers`` workers (a comma list runs
each count in turn, one result per count) hold at least
``--pages`` distinct pages (32-byte hashes, as SHA-256 page hashes are).
Pages form 32-page conversations; every 32 conversations share a 4-page
system prompt; a conversation lives on one worker and, one time in four, on a
second one too, so the first pages of a prompt are held by many workers and
each walk has workers dropping out at different depths.

Measured in one run:

- ingestion: every worker's `PagesStored` batches (msgpack, 16 conversations a
  batch) go through `Coordinator.report` (decode, checks, lock, apply) —
  ``ingest_page_events_per_s`` = page hashes in those events / wall seconds
  (``..._per_cpu_s``: / process CPU seconds); then
  removal batches for a quarter of the conversations
  (``remove_page_events_per_s``). The baseline decodes the same batches and
  updates one Python set per worker.
- routing: `Coordinator.route` (index walk + kv_aware policy + stats, under
  the lock) for 32-page prompts that hit fully, hit their first half, or only
  their system prompt; p50/p99 of single calls. The baseline ("naive") keeps
  one set of hashes per worker and, for each worker, probes the prompt's
  pages until the first miss (cost: workers x prefix), then runs the same
  policy. Both must give the same overlaps (checked).
- the machine: ``load_avg_1m`` and ``cpus``, because on a shared machine the
  wall-clock p99 measures the scheduler as much as the code;
  ``route_cpu_p99_ms`` is the same percentile of the calls' thread CPU time.
- index operations, Dynamo's definition (events applied plus prefix
  matches) on a bare `GlobalIndex` in this one process: every stored and
  removal batch (decoded beforehand: decoding belongs to the transport) and
  ``--routes`` prefix matches. ``index_ops_per_s`` counts each page hash of an
  event as one op and each match as one (``index_event_ops_per_s`` counts each
  KV event as one instead); ``cpu_s_per_million_ops`` is process CPU seconds
  per million page ops.
- memory: a fresh `GlobalIndex` is built from the same batches under
  `tracemalloc`; ``bytes_per_page`` = bytes still allocated (Python objects
  and numpy arrays, which report to tracemalloc) plus the bytes of the
  index's native containers that tracemalloc cannot see (`extra_bytes`,
  roaring bitmaps), / distinct pages indexed. ``rss_bytes_per_page`` is the
  resident-set growth of a fresh process while it builds the same index
  without tracemalloc, / the same pages (coarser: it also counts allocator
  slack and numpy's over-allocation), after it built and dropped a small
  index first (what the libraries map in on first use is not per page).
  With ``--shards``, ``bytes_per_page`` is that figure for the sharded
  coordinator of each shard count fed through ``report``.

Each measurement is one function taking the workload and returning its
figures, so further dimensions (shards, replicas) add a function and a flag.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from typing import Any

from kvmesh.arguments import non_negative_int, positive_int
from kvmesh.config import CoordinatorConfig
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import RouteRequest, WorkerLoad, make_policy
from kvmesh.coordinator.service import Coordinator
from kvmesh.coordinator.shards import ShardedCoordinator
from kvmesh.errors import InvalidInput
from kvmesh.events import PagesRemoved, PagesStored, decode_batch, encode_batch, make_batch
from kvmesh.stats import percentile
from kvmesh.types import PageHash, WorkerId

CONV_PAGES = 32
SYSTEM_PAGES = 4
GROUP = 32
BATCH_CONVS = 16
PAGE_SIZE = 16
ROUTE_CPU_PASSES = 5
"""With --shards: passes over the ingest and the routes, each through every shard count side
by side (`_side_by_side`). The least CPU time of each count counts (a shared machine's noise
only ever adds), and the ratios between counts are also taken pass by pass (`paired_ratios`)."""
INGEST_CHUNK = 32
"""With --shards: stored batches (16 conversations each) fed to each shard count in turn."""


LABELS = {
    "route_p50_ms": "route p50 ms (in process)",
    "route_p99_ms": "route p99 ms (in process)",
    "ray_route_p50_ms": "route p50 ms (through Ray actors)",
    "ray_route_p99_ms": "route p99 ms (through Ray actors)",
    "ray_fan_out_floor_p50_ms": "Ray fan-out alone p50 ms (empty actors)",
    "ray_fan_out_floor_p99_ms": "Ray fan-out alone p99 ms (empty actors)",
}
"""How the table names the figures whose JSON keys do not say where they were measured."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers",
        type=_counts,
        default=[64],
        help="workers in the index; a comma list (8,64,256) measures each",
    )
    parser.add_argument(
        "--pages", type=positive_int, default=1_000_000, help="distinct pages, at least"
    )
    parser.add_argument("--routes", type=positive_int, default=10_000, help="route calls timed")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc build")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--shards",
        type=_shard_counts,
        default=None,
        help="index shard counts (1,2,4): measure the sharded coordinator for each instead",
    )
    parser.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="router replicas with --shards (2+: failover gap)",
    )
    parser.add_argument(
        "--ray-pages",
        type=positive_int,
        default=20_000,
        help="with --shards: distinct pages of the index built on Ray actors",
    )
    parser.add_argument(
        "--no-ray", action="store_true", help="with --shards: only the in-process figures"
    )
    parser.add_argument(
        "--route-batch",
        type=positive_int,
        default=16,
        help="with --shards: routes per call for the batched CPU figures (concurrent routes)",
    )


def _comma_counts(text: str, what: str, example: str, least: int) -> list[int]:
    """A comma list of `what` counts, each at least `least`; argparse's error otherwise."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {what} counts like {example}, got {text!r}"
        ) from None
    if not counts or min(counts) < least:
        raise argparse.ArgumentTypeError(
            f"each {what} count must be at least {least}, got {text!r}"
        )
    return counts


def _counts(text: str) -> list[int]:
    return _comma_counts(text, "worker", "8,64,256", 2)


def _h(i: int) -> PageHash:
    return PageHash(hashlib.sha256(i.to_bytes(8, "little")).digest())


class _Workload:
    """Conversations (page hash chains), their holders, and the encoded batches."""

    def __init__(self, workers: int, pages: int, seed: int) -> None:
        rng = random.Random(seed)
        per_group = SYSTEM_PAGES + GROUP * (CONV_PAGES - SYSTEM_PAGES)
        groups = -(-pages // per_group)
        self.worker_ids = [WorkerId(f"worker-{i:03d}") for i in range(workers)]
        self.convs: list[list[PageHash]] = []
        counter = 0
        for _ in range(groups):
            system = [_h(counter + k) for k in range(SYSTEM_PAGES)]
            counter += SYSTEM_PAGES
            for _ in range(GROUP):
                own = [_h(counter + k) for k in range(CONV_PAGES - SYSTEM_PAGES)]
                counter += CONV_PAGES - SYSTEM_PAGES
                self.convs.append(system + own)
        self.distinct_pages = counter
        self.fresh_counter = counter
        self.holders: list[list[int]] = []
        by_worker: list[list[int]] = [[] for _ in range(workers)]
        for c in range(len(self.convs)):
            hs = [rng.randrange(workers)]
            if rng.random() < 0.25:
                hs.append((hs[0] + 1 + rng.randrange(workers - 1)) % workers)
            self.holders.append(hs)
            for w in hs:
                by_worker[w].append(c)
        self.by_worker = by_worker
        self.seq = [0] * workers
        self.stored_events = 0
        per_worker: list[list[tuple[WorkerId, bytes]]] = []
        for w, convs in enumerate(by_worker):
            mine = []
            for i in range(0, len(convs), BATCH_CONVS):
                evs = [
                    PagesStored(tuple(self.convs[c]), None, (), PAGE_SIZE, None, "gpu")
                    for c in convs[i : i + BATCH_CONVS]
                ]
                self.stored_events += sum(len(e.page_hashes) for e in evs)
                mine.append((self.worker_ids[w], self._encode(w, evs)))
            per_worker.append(mine)
        # Interleave workers, as their reports would arrive.
        self.stored_batches = [
            b
            for k in range(max(map(len, per_worker)))
            for b in (m[k] for m in per_worker if k < len(m))
        ]
        self.removed_batches: list[tuple[WorkerId, bytes]] = []
        self.removed_events = 0
        for w, convs in enumerate(by_worker):
            gone = convs[: len(convs) // 4]
            for i in range(0, len(gone), BATCH_CONVS):
                gone_evs = [
                    PagesRemoved(tuple(self.convs[c][SYSTEM_PAGES:]), "gpu")
                    for c in gone[i : i + BATCH_CONVS]
                ]
                self.removed_events += sum(len(e.page_hashes) for e in gone_evs)
                self.removed_batches.append((self.worker_ids[w], self._encode(w, gone_evs)))

    def _encode(self, w: int, events: Sequence[Any]) -> bytes:
        data = encode_batch(make_batch(events, self.worker_ids[w], "inc-0", self.seq[w]))
        self.seq[w] += 1
        return data

    def fresh(self, n: int) -> list[PageHash]:
        out = [_h(self.fresh_counter + k) for k in range(n)]
        self.fresh_counter += n
        return out

    def prompts(self, n: int, rng: random.Random) -> list[list[PageHash]]:
        """32-page prompts: a third hit fully, a third half, a third only the system prompt."""
        out = []
        kept = [c for c in range(len(self.convs)) if c % 4 != 0]  # mostly not removed
        for i in range(n):
            conv = self.convs[rng.choice(kept)]
            keep = (CONV_PAGES, CONV_PAGES // 2, SYSTEM_PAGES)[i % 3]
            out.append(conv[:keep] + self.fresh(CONV_PAGES - keep))
        return out


class _NaiveIndex:
    """Baseline: one set of hashes per worker; a lookup probes every worker's set per page."""

    def __init__(self) -> None:
        self.sets: dict[WorkerId, set[PageHash]] = {}

    def apply_encoded(self, data: bytes) -> None:
        batch = decode_batch(data)
        s = self.sets.setdefault(batch.worker_id, set())
        for ev in batch.events:
            if isinstance(ev, PagesStored):
                s.update(ev.page_hashes)
            elif isinstance(ev, PagesRemoved):
                s.difference_update(ev.page_hashes)
            else:
                s.clear()

    def match(self, hashes: Sequence[PageHash]) -> dict[WorkerId, int]:
        out: dict[WorkerId, int] = {}
        for w, s in self.sets.items():
            n = 0
            for h in hashes:
                if h not in s:
                    break
                n += 1
            if n:
                out[w] = n
        return out


def _register(wl: _Workload, coord: Coordinator | ShardedCoordinator) -> None:
    """Every worker of `wl` registered in `coord` (not timed)."""
    for w in wl.worker_ids:
        coord.register_worker(WorkerRegistration(w, f"127.0.0.1:{len(w)}", 100_000, "inc-0"))


def _fed(wl: _Workload, coord: Coordinator | ShardedCoordinator) -> tuple[float, float]:
    """Registers every worker in `coord`, then reports every stored batch: the wall and
    process CPU seconds the reports took (registering is not timed)."""
    _register(wl, coord)
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    for wid, data in wl.stored_batches:
        coord.report(WorkerReport(wid, [data]))
    return time.perf_counter() - t0, time.process_time() - c0


def _ingest(wl: _Workload, coord: Coordinator, naive: _NaiveIndex) -> dict[str, Any]:
    """Stored then removal batches through `Coordinator.report`; the naive sets as baseline."""
    ingest_s, ingest_cpu = _fed(wl, coord)
    t0 = time.perf_counter()
    for wid, data in wl.removed_batches:
        coord.report(WorkerReport(wid, [data]))
    remove_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    for _, data in wl.stored_batches:
        naive.apply_encoded(data)
    naive_ingest_s, naive_cpu = time.perf_counter() - t0, time.process_time() - c0
    for _, data in wl.removed_batches:
        naive.apply_encoded(data)
    return {
        "ingest_page_events_per_s": round(wl.stored_events / ingest_s),
        "remove_page_events_per_s": round(wl.removed_events / remove_s),
        "naive_ingest_page_events_per_s": round(wl.stored_events / naive_ingest_s),
        "ingest_ratio_vs_naive": round(naive_ingest_s / ingest_s, 2),
        "ingest_page_events_per_cpu_s": round(wl.stored_events / ingest_cpu),
        "naive_ingest_page_events_per_cpu_s": round(wl.stored_events / naive_cpu),
        "page_events_ingested": wl.stored_events,
    }


def _routing(
    wl: _Workload,
    coord: Coordinator,
    naive: _NaiveIndex,
    prompts: list[list[PageHash]],
    rng: random.Random,
    seed: int,
) -> dict[str, Any]:
    """`Coordinator.route` per call (wall and thread CPU) against the naive per-worker probe."""
    loads = [
        WorkerLoad(w, rng.randrange(0, 4096), rng.randrange(0, 2048), 50_000, 100_000)
        for w in wl.worker_ids
    ]
    for w, load in zip(wl.worker_ids, loads, strict=True):
        coord.heartbeat(w, load)
    for p in prompts[:200]:  # same overlaps from both indexes
        if coord.match(p).pages != naive.match(p):
            raise SystemExit("bench router: index and naive baseline disagree on a prefix")
    ours: list[float] = []
    ours_cpu: list[float] = []
    for p in prompts:
        c = time.thread_time_ns()
        t = time.perf_counter_ns()
        coord.route(RouteQuery(p, CONV_PAGES * PAGE_SIZE, page_size=PAGE_SIZE))
        ours.append((time.perf_counter_ns() - t) / 1e6)
        ours_cpu.append((time.thread_time_ns() - c) / 1e6)
    policy = make_policy("kv_aware", CoordinatorConfig(), random.Random(seed))
    theirs: list[float] = []
    for p in prompts[: max(200, len(prompts) // 10)]:
        t = time.perf_counter_ns()
        req = RouteRequest(p, CONV_PAGES * PAGE_SIZE, PAGE_SIZE)
        policy.choose(req, naive.match(p), loads)
        theirs.append((time.perf_counter_ns() - t) / 1e6)
    match_us = []
    for p in prompts[: min(2000, len(prompts))]:
        t = time.perf_counter_ns()
        coord.index.match(p)
        match_us.append((time.perf_counter_ns() - t) / 1e3)
    stats = coord.stats()
    return {
        "route_p50_ms": round(percentile(ours, 50), 4),
        "route_p99_ms": round(percentile(ours, 99), 4),
        "route_mean_ms": round(statistics.fmean(ours), 4),
        "route_cpu_p50_ms": round(percentile(ours_cpu, 50), 4),
        "route_cpu_p99_ms": round(percentile(ours_cpu, 99), 4),
        "match_p50_us": round(percentile(match_us, 50), 1),
        "naive_route_p50_ms": round(percentile(theirs, 50), 4),
        "naive_route_p99_ms": round(percentile(theirs, 99), 4),
        "route_p99_speedup_vs_naive": round(percentile(theirs, 99) / percentile(ours, 99), 2),
        "index_pages_after_removals": stats.indexed_pages,
        "index_entries_after_removals": stats.index_entries,
    }


def _index_ops(wl: _Workload, prompts: list[list[PageHash]]) -> dict[str, Any]:
    """Events applied plus prefix matches on a bare `GlobalIndex`, one process, one thread."""
    stored = [decode_batch(data) for _, data in wl.stored_batches]
    removed = [decode_batch(data) for _, data in wl.removed_batches]
    events = sum(len(b.events) for b in stored) + sum(len(b.events) for b in removed)
    index = GlobalIndex()
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    for b in stored:
        index.apply_decoded(b)
    for b in removed:
        index.apply_decoded(b)
    for p in prompts:
        index.match(p)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    page_ops = wl.stored_events + wl.removed_events + len(prompts)
    return {
        "index_ops_per_s": round(page_ops / wall),
        "index_ops_per_cpu_s": round(page_ops / cpu),
        "index_event_ops_per_s": round((events + len(prompts)) / wall),
        "cpu_s_per_million_ops": round(cpu / (page_ops / 1e6), 3),
        "index_ops": page_ops,
    }


def _build(wl: _Workload) -> GlobalIndex:
    index = GlobalIndex()
    for _, data in wl.stored_batches:
        index.apply_encoded(data)
    return index


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _build_sharded(wl: _Workload, shards: int) -> Any:
    """A `ShardedCoordinator` fed the stored batches through `report` (decode, checks, apply)."""
    from kvmesh.coordinator.shards import ShardedCoordinator

    coord = ShardedCoordinator(CoordinatorConfig(policy="kv_aware", index_shards=shards))
    _register(wl, coord)
    for wid, data in wl.stored_batches:
        coord.report(WorkerReport(wid, [data]))
    return coord


def _rss_growth(workers: int, pages: int, seed: int, shards: int, out: Any) -> None:
    """In a fresh process (no freed memory to reuse): resident-set growth while the index is built.

    `shards` 0: a bare `GlobalIndex`; N: a `ShardedCoordinator` of N shards. A small
    index of the same kind is built and dropped first, so that what the first use
    of numpy, msgpack and pyroaring maps in (code, caches) is not counted per page.
    """

    def build(wl: _Workload) -> Any:
        return _build(wl) if shards == 0 else _build_sharded(wl, shards)

    build(_Workload(8, 5_000, seed + 1))  # built and dropped at once
    wl = _Workload(workers, pages, seed)
    gc.collect()
    before = _rss_bytes()
    index = build(wl)
    gc.collect()
    out.put((_rss_bytes() - before, wl.distinct_pages))
    del index


def _rss_per_page(workers: int, pages: int, seed: int, shards: int = 0) -> float:
    """Resident bytes per distinct page of an index built in a fresh process (`_rss_growth`)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_rss_growth, args=(workers, pages, seed, shards, out))
    child.start()
    grown, indexed = out.get()
    child.join()
    return round(grown / indexed, 1)


def _memory(wl: _Workload, workers: int, pages: int, seed: int) -> dict[str, Any]:
    """Bytes the index keeps per distinct page, hash objects and worker sets included."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = _build(wl)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - base
    native = getattr(index, "extra_bytes", lambda: 0)()
    pages, entries = len(index), index.num_entries()
    del index
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    naive = _NaiveIndex()
    for _, data in wl.stored_batches:
        naive.apply_encoded(data)
    gc.collect()
    naive_used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    used = traced + native
    return {
        "bytes_per_page": round(used / pages, 1),
        "bytes_per_entry": round(used / entries, 1),
        "traced_bytes_per_page": round(traced / pages, 1),
        "native_bytes_per_page": round(native / pages, 1),
        "rss_bytes_per_page": _rss_per_page(workers, pages, seed),
        "memory_pages": pages,
        "memory_entries": entries,
        "index_mib": round(used / 2**20, 1),
        "naive_bytes_per_page": round(naive_used / pages, 1),
    }


def measure_one(workers: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every figure for one worker count."""
    t_build = time.perf_counter()
    wl = _Workload(workers, args.pages, args.seed)
    build_s = time.perf_counter() - t_build
    rng = random.Random(args.seed + 1)
    prompts = wl.prompts(args.routes, rng)
    coord = Coordinator(CoordinatorConfig(policy="kv_aware"), rng=random.Random(args.seed))
    naive = _NaiveIndex()
    result: dict[str, Any] = {"workers": workers, "indexed_pages": wl.distinct_pages}
    ingest = _ingest(wl, coord, naive)
    result.update(_routing(wl, coord, naive, prompts, rng, args.seed))
    result.update(ingest)
    del coord, naive
    gc.collect()
    result.update(_index_ops(wl, prompts))
    gc.collect()
    if not args.no_memory:
        result.update(_memory(wl, workers, args.pages, args.seed))
    result.update(
        {
            "workload_build_s": round(build_s, 1),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(),
        }
    )
    return result


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [measure_one(workers, args) for workers in args.workers]


@contextlib.contextmanager
def _stdout_on_stderr() -> Iterator[None]:
    """Everything written to stdout meanwhile goes to stderr: Python's prints, and what
    Ray's processes (started meanwhile, so inheriting the descriptor) and its log threads
    write there, such as its "(raylet)" lines; ``--json`` keeps stdout for the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(args: argparse.Namespace) -> int:
    if args.json:
        with _stdout_on_stderr():
            results = measure_sharded(args) if args.shards else measure(args)
        for result in results:
            print(json.dumps(result))
        return 0
    results = measure_sharded(args) if args.shards else measure(args)
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvmesh bench router")
    table.add_column("figure")
    for result in results:
        label = (
            f"{result['shards']} shards" if "shards" in result else f"{result['workers']} workers"
        )
        table.add_column(label, justify="right")
    for k in results[0]:
        cells = [r.get(k) for r in results]
        label = LABELS.get(k, k)
        table.add_row(label, *(f"{v:,}" if isinstance(v, int) else str(v) for v in cells))
    Console().print(table)
    return 0


# ------------------------------------------------------------------ shards and replicas
# (`--shards 1,2,4 --replicas M`: docs/scale.md reads these figures)


def _shard_counts(text: str) -> list[int]:
    return _comma_counts(text, "shard", "1,2,4", 1)


def _side_by_side(
    wl: _Workload, shard_counts: Sequence[int], seed: int
) -> tuple[list[ShardedCoordinator], list[float], list[float]]:
    """A fresh `ShardedCoordinator` of each count, every one fed every stored batch through
    `report`, with each count's wall and thread CPU seconds in those reports.

    The batches go `INGEST_CHUNK` at a time, each chunk to every count in turn,
    the count that goes first rotating chunk by chunk: the counts compared meet
    the same moments of a shared machine and the same live memory (all of them
    are built together), where counts built one after another, each alone,
    measured the machine's minute as much as their own cost.
    """
    coords = [
        ShardedCoordinator(
            CoordinatorConfig(policy="kv_aware", index_shards=shards), rng=random.Random(seed)
        )
        for shards in shard_counts
    ]
    for coord in coords:
        _register(wl, coord)
    gc.collect()
    wall_ns = [0] * len(coords)
    cpu_ns = [0] * len(coords)
    batches = wl.stored_batches
    for j, at in enumerate(range(0, len(batches), INGEST_CHUNK)):
        reports = [WorkerReport(wid, [data]) for wid, data in batches[at : at + INGEST_CHUNK]]
        for k in _rotated(len(coords), j):
            coord = coords[k]
            c, t = time.thread_time_ns(), time.perf_counter_ns()
            for report in reports:
                coord.report(report)
            wall_ns[k] += time.perf_counter_ns() - t
            cpu_ns[k] += time.thread_time_ns() - c
    return coords, [ns / 1e9 for ns in wall_ns], [ns / 1e9 for ns in cpu_ns]


def _rotated(n: int, turn: int) -> list[int]:
    """0..n-1 starting at `turn` modulo n: which count goes first changes every turn."""
    first = turn % n
    return [*range(first, n), *range(first)]


def _sharded_in_process(
    wl: _Workload,
    prompts: list[list[PageHash]],
    shard_counts: Sequence[int],
    seed: int,
    route_batch: int,
) -> list[dict[str, Any]]:
    """`ShardedCoordinator` of each shard count in one process: its ingest and route cost,
    CPU per op; one object per count, in order.

    The shards run one after another here, so this is the CPU the sharded
    design costs per operation (the fan-out and merge included), not the
    wall-clock gain of shards on separate cores. Routes are measured one call
    each (``cpu_s_per_million_ops``) and ``route_batch`` to a call
    (``batched_...``: `route_many`, what a router does with concurrent routes).
    Each of ``ROUTE_CPU_PASSES`` passes builds every count's index side by side
    (`_side_by_side`) and routes every count a batch at a time in turn, so the
    counts compared meet the same moments of the machine (its CPU figures moved
    by a third between runs of the same code). The absolute figures are the
    least of the passes (noise only ever adds); ``cpu_per_op_ratio_paired_median``
    (and ``_range``, the batched pair, and ``route_cpu_ratio_paired_...`` for the
    routes alone) take each pass's ratio to the first count (`paired_ratios`).
    """
    counts = list(shard_counts)
    ingest_s = [math.inf] * len(counts)
    ingest_passes: list[list[float]] = []  # thread CPU s, [pass][count]
    batched_passes: list[list[float]] = []
    route_passes: list[list[float]] = []
    queries = [RouteQuery(p, CONV_PAGES * PAGE_SIZE, page_size=PAGE_SIZE) for p in prompts]
    batches = [queries[k : k + route_batch] for k in range(0, len(queries), route_batch)]
    built: list[ShardedCoordinator] = []
    for _ in range(ROUTE_CPU_PASSES):
        built = []  # the last pass's indexes go before the next pass builds its own
        gc.collect()
        built, wall, cpu = _side_by_side(wl, counts, seed)
        ingest_s = [min(a, b) for a, b in zip(ingest_s, wall, strict=True)]
        ingest_passes.append(cpu)
        _heartbeats(wl, built, seed)
        # Looks (no request id) change nothing, so every pass routes the same.
        batched_ns = [0] * len(counts)
        route_ns = [0] * len(counts)
        for j, batch in enumerate(batches):
            for k in _rotated(len(counts), j):
                coord = built[k]
                c = time.thread_time_ns()
                coord.route_many(batch)
                batched_ns[k] += time.thread_time_ns() - c
                c = time.thread_time_ns()
                for query in batch:
                    coord.route(query)
                route_ns[k] += time.thread_time_ns() - c
        batched_passes.append([ns / 1e9 for ns in batched_ns])
        route_passes.append([ns / 1e9 for ns in route_ns])
    times: list[list[float]] = []
    cpu_times: list[list[float]] = []
    for coord in built:  # single calls' latency, for the percentiles
        wall_ms: list[float] = []
        cpu_ms: list[float] = []
        for query in queries:
            c = time.thread_time_ns()
            t = time.perf_counter_ns()
            coord.route(query)
            wall_ms.append((time.perf_counter_ns() - t) / 1e6)
            cpu_ms.append((time.thread_time_ns() - c) / 1e6)
        times.append(wall_ms)
        cpu_times.append(cpu_ms)
    ingest_cpu = [min(column) for column in zip(*ingest_passes, strict=True)]
    batched_cpu = [min(column) for column in zip(*batched_passes, strict=True)]
    route_cpu = [min(column) for column in zip(*route_passes, strict=True)]
    paired = {
        "cpu_per_op_ratio": paired_ratios(_pass_totals(ingest_passes, route_passes)),
        "batched_cpu_per_op_ratio": paired_ratios(_pass_totals(ingest_passes, batched_passes)),
        "route_cpu_ratio": paired_ratios(route_passes),
        "batched_route_cpu_ratio": paired_ratios(batched_passes),
        "ingest_cpu_ratio": paired_ratios(ingest_passes),
    }
    ops = wl.stored_events + len(prompts)
    return [
        {
            # the same percentile of the calls' thread CPU time: what the code costs,
            # without the waits of a shared machine's scheduler
            "route_cpu_p50_ms": round(percentile(cpu_times[k], 50), 4),
            "route_cpu_p99_ms": round(percentile(cpu_times[k], 99), 4),
            "index_ops_per_cpu_s": round(ops / (ingest_cpu[k] + route_cpu[k])),
            "route_p50_ms": round(percentile(times[k], 50), 4),
            "route_p99_ms": round(percentile(times[k], 99), 4),
            "ingest_page_events_per_s": round(wl.stored_events / ingest_s[k]),
            "index_ops_per_s": round(ops / (ingest_s[k] + sum(times[k]) / 1e3)),
            "cpu_s_per_million_ops": round((ingest_cpu[k] + route_cpu[k]) / ops * 1e6, 3),
            "route_cpu_us_per_call": round(route_cpu[k] / len(prompts) * 1e6, 1),
            "ingest_cpu_s_per_million_events": round(ingest_cpu[k] / wl.stored_events * 1e6, 3),
            "route_batch": route_batch,
            "batched_cpu_s_per_million_ops": round((ingest_cpu[k] + batched_cpu[k]) / ops * 1e6, 3),
            "batched_route_cpu_us_per_call": round(batched_cpu[k] / len(prompts) * 1e6, 1),
            **{
                f"{name}_paired_{part}": value
                for name, ratios in paired.items()
                for part, value in (("median", ratios[k][0]), ("range", list(ratios[k][1:])))
            },
        }
        for k in range(len(built))
    ]


def _heartbeats(wl: _Workload, coords: Sequence[ShardedCoordinator], seed: int) -> None:
    """The same loads for every worker in each of `coords`."""
    for coord in coords:
        rng = random.Random(seed)
        for w in wl.worker_ids:
            coord.heartbeat(
                w, WorkerLoad(w, rng.randrange(0, 4096), rng.randrange(0, 2048), 50_000, 100_000)
            )


def _pass_totals(ingest: list[list[float]], routes: list[list[float]]) -> list[list[float]]:
    """Each pass's ingest plus route CPU seconds, per shard count: [pass][count]."""
    return [[i + r for i, r in zip(a, b, strict=True)] for a, b in zip(ingest, routes, strict=True)]


def paired_ratios(totals: Sequence[Sequence[float]]) -> list[tuple[float, float, float]]:
    """For each shard count, the median, least and greatest over passes of its CPU in a pass
    over the first count's in the same pass.

    The counts of one pass run minutes apart at most, so a machine that slows for a while
    (another tenant's memory traffic moved this bench's ingest by a third from run to run)
    slows every count of that pass alike: a ratio taken within passes keeps what the least
    CPU of each count, taken in different passes, can lose.
    """
    if not totals or not totals[0]:
        raise InvalidInput("paired_ratios needs at least one pass of at least one count")
    out = []
    for k in range(len(totals[0])):
        ratios = [row[k] / row[0] for row in totals]
        out.append(
            (round(statistics.median(ratios), 3), round(min(ratios), 3), round(max(ratios), 3))
        )
    return out


def _ray_routes(routers: Sequence[Any], prompts: list[list[PageHash]]) -> list[list[float]]:
    """Each prompt routed through each router in turn: one list of times (ms) per router,
    taken side by side, so that they saw the same moments of a shared machine."""
    import ray

    times: list[list[float]] = [[] for _ in routers]
    for p in prompts:
        query = RouteQuery(p, CONV_PAGES * PAGE_SIZE, PAGE_SIZE)
        for router, out in zip(routers, times, strict=True):
            t = time.perf_counter_ns()
            ray.get(router.route.remote(query))
            out.append((time.perf_counter_ns() - t) / 1e6)
    return times


def _ray_waves(
    router: Any, prompts: list[list[PageHash]], in_flight: int
) -> tuple[float, list[float]]:
    """Routes `in_flight` at a time through `router`, as a busy router receives them: routes
    per second, and each wave's time (ms) from its first call to its last answer."""
    import ray

    queries = [RouteQuery(p, CONV_PAGES * PAGE_SIZE, PAGE_SIZE) for p in prompts]
    waves: list[float] = []
    t0 = time.perf_counter()
    for k in range(0, len(queries), in_flight):
        t = time.perf_counter_ns()
        ray.get([router.route.remote(q) for q in queries[k : k + in_flight]])
        waves.append((time.perf_counter_ns() - t) / 1e6)
    return len(queries) / (time.perf_counter() - t0), waves


def _shard_view_calls(cfg: CoordinatorConfig) -> int:
    """The `view_many` calls every shard actor of every replica of `cfg` has served: a
    hedge to another replica's shard counts as the call it is."""
    import ray

    from kvmesh.router_replicas import shard_actor_name

    handles = [
        ray.get_actor(shard_actor_name(cfg, rep, s), namespace=cfg.namespace)
        for rep in range(cfg.router_replicas)
        for s in range(cfg.index_shards)
    ]
    counts: list[dict[str, int]] = ray.get([h.calls.remote() for h in handles])
    return sum(calls.get("view_many", 0) for calls in counts)


class _EmptyShard:
    """A shard actor that answers at once: with `_FanOut`, what Ray alone costs a route."""

    async def view(self, query: RouteQuery) -> None:
        return None


class _FanOut:
    """A router actor asking every `_EmptyShard` and waiting for all, as `RouterActor.route`
    asks its shards: the floor under ``ray_route_*`` on this machine (no index, no policy)."""

    def __init__(self, shards: Sequence[Any]) -> None:
        self.shards = list(shards)

    async def route(self, query: RouteQuery) -> None:
        import asyncio

        await asyncio.gather(*(s.view.remote(query) for s in self.shards))


def _fan_out_floor(shards: int) -> tuple[Any, list[Any]]:
    """A `_FanOut` router over `shards` `_EmptyShard`s (no CPU reserved, as kvmesh's actors)."""
    import ray

    empty = [ray.remote(_EmptyShard).options(num_cpus=0).remote() for _ in range(shards)]
    return ray.remote(_FanOut).options(num_cpus=0).remote(empty), empty


def _failover_gap_ms(routers: list[Any], prompts: list[list[PageHash]], kill: Any) -> float:
    """Longest wait between two answered routes of one client while `kill()` takes a replica down.

    The client asks its router and, when that one is gone, the next one (as
    `KVMesh` and `RoutingClient` do).
    """
    import threading

    import ray

    stamps: list[float] = []
    stop = threading.Event()

    def client() -> None:
        order = list(routers)
        i = 0
        while not stop.is_set():
            p = prompts[i % len(prompts)]
            i += 1
            try:
                ray.get(
                    order[0].route.remote(RouteQuery(p, CONV_PAGES * PAGE_SIZE, PAGE_SIZE)),
                    timeout=30,
                )
                stamps.append(time.perf_counter())
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                order = order[1:] + order[:1]

    thread = threading.Thread(target=client)
    thread.start()
    time.sleep(1.0)
    t_kill = time.perf_counter()
    kill()
    time.sleep(2.0)
    stop.set()
    thread.join(60)
    around = [t for t in stamps if t >= t_kill - 0.5]
    gaps = [b - a for a, b in itertools.pairwise(around)]
    return round(max(gaps) * 1e3, 1) if gaps else float("nan")


def _sharded_on_ray(shards: int, replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    """The layout on Ray actors (this machine): route p99 through a router, failover gaps."""
    import uuid

    import ray

    from kvmesh.coordinator.router import create_layout
    from kvmesh.router_replicas import shard_actor_name

    workers = args.workers[0]
    wl = _Workload(workers, args.ray_pages, args.seed)
    prompts = wl.prompts(min(args.routes, 2000), random.Random(args.seed + 2))
    cfg = CoordinatorConfig(
        namespace=f"bench-{uuid.uuid4().hex[:8]}",
        index_shards=shards,
        router_replicas=replicas,
        heartbeat_timeout_s=600.0,
    )
    routers = create_layout(cfg)
    ray.get([r.wait_ready.remote(60) for r in routers], timeout=120)
    r0 = routers[0]
    ray.get(
        [
            r0.register_worker.remote(WorkerRegistration(w, "127.0.0.1:1", 100_000, "inc-0"))
            for w in wl.worker_ids
        ]
    )
    for k in range(0, len(wl.stored_batches), 64):
        ray.get([r0.report.remote(WorkerReport(w, [d])) for w, d in wl.stored_batches[k : k + 64]])
    floor, empty = _fan_out_floor(shards)
    _ray_routes([r0, floor], prompts[:100])  # warm the handles
    times, floor_times = _ray_routes([r0, floor], prompts)
    for actor in (floor, *empty):
        ray.kill(actor)
    calls_before = _shard_view_calls(cfg)
    per_s, waves = _ray_waves(r0, prompts, args.route_batch)
    shard_calls = _shard_view_calls(cfg) - calls_before
    out: dict[str, Any] = {
        "ray_route_p50_ms": round(percentile(times, 50), 3),
        "ray_route_p99_ms": round(percentile(times, 99), 3),
        # the same fan-out with empty actors, measured route by route beside the real one
        "ray_fan_out_floor_p50_ms": round(percentile(floor_times, 50), 3),
        "ray_fan_out_floor_p99_ms": round(percentile(floor_times, 99), 3),
        "ray_indexed_pages": wl.distinct_pages,
        # one client: routes per second one at a time, then `--route-batch` at a time
        "ray_routes_per_s": round(len(times) / (sum(times) / 1e3)),
        "ray_in_flight": args.route_batch,
        "ray_in_flight_routes_per_s": round(per_s),
        "ray_in_flight_wave_p50_ms": round(percentile(waves, 50), 3),
        "ray_in_flight_wave_p99_ms": round(percentile(waves, 99), 3),
        # what a shard was asked per call meanwhile: the router's batches (`RouterActor.view`)
        "ray_in_flight_routes_per_shard_call": round(len(prompts) * shards / shard_calls, 2),
    }
    if replicas > 1:
        out["failover_gap_ms"] = _failover_gap_ms(
            routers, prompts, lambda: ray.kill(r0, no_restart=True)
        )
        shard = ray.get_actor(shard_actor_name(cfg, 1, 0), namespace=cfg.namespace)
        out["shard_failover_gap_ms"] = _failover_gap_ms(
            routers[1:], prompts, lambda: ray.kill(shard, no_restart=False)
        )
        out["heartbeat_interval_ms"] = round(cfg.heartbeat_interval_s * 1e3)
    # shards first: the routers hold their handles, and Ray collects a shard nobody holds
    for rep in range(replicas):
        for s in range(shards):
            with contextlib.suppress(ValueError):  # already collected
                ray.kill(ray.get_actor(shard_actor_name(cfg, rep, s), namespace=cfg.namespace))
    for r in routers:
        ray.kill(r, no_restart=True)
    return out


def measure_sharded(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One object per shard count: in-process cost per op, then the same layout on Ray."""
    import ray

    workers = args.workers[0]
    wl = _Workload(workers, args.pages, args.seed)
    prompts = wl.prompts(args.routes, random.Random(args.seed + 1))
    results = []
    measured = _sharded_in_process(wl, prompts, args.shards, args.seed, args.route_batch)
    gc.collect()
    for shards, figures in zip(args.shards, measured, strict=True):
        result: dict[str, Any] = {
            "shards": shards,
            "replicas": args.replicas,
            "workers": workers,
            "indexed_pages": wl.distinct_pages,
            **figures,
        }
        if not args.no_memory:
            result["bytes_per_page"] = _rss_per_page(workers, args.pages, args.seed, shards)
        results.append(result)
    del wl, prompts
    gc.collect()
    if args.no_ray:
        return _ratios(results)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for result in results:
            result.update(_sharded_on_ray(result["shards"], args.replicas, args))
    finally:
        if owns_ray:
            ray.shutdown()
    return _ratios(results)


def _ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CPU per op against the first shard count's, and the machine's load."""
    first = results[0]
    for result in results:
        for key, ratio in (
            ("cpu_s_per_million_ops", "cpu_per_op_ratio_vs_first"),
            ("batched_cpu_s_per_million_ops", "batched_cpu_per_op_ratio_vs_first"),
            ("route_cpu_us_per_call", "route_cpu_ratio_vs_first"),
            ("batched_route_cpu_us_per_call", "batched_route_cpu_ratio_vs_first"),
        ):
            result[ratio] = round(result[key] / first[key], 2)
        result["load_avg_1m"] = round(os.getloadavg()[0], 2)
        result["cpus"] = os.cpu_count()
    return results
