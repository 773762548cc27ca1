"""`kvmesh bench load`: many concurrent clients against the embedded cluster, bounded in time.

One embedded Ray cluster (``--workers`` worker actors, the small default
model, ``--num-pages`` pages per pool, its own coordinator namespace). The
clients are asyncio tasks in this process, each looping over
`KVMesh.agenerate` until the phase's time is up; a prompt is one of
``--prefixes`` shared prefixes (``--prefix-pages`` full pages) plus a random
suffix, so there are local hits, pulls, computes and evictions.

Phases, in order::

    warm-up      --clients clients until every pool page was written
                 --warmup-cycles times (at most --warmup s)
    RSS before   coordinator and worker processes
    baseline     one client, sequential, --baseline-duration s
    load         --clients clients, --duration s
    RSS after
    route burst  one client, then --clients clients, calling `aroute` only

Figures: requests/s, p50/p99 latency (client side: route + serve + record)
and errors for the baseline and the load; ``speedup_vs_single_client`` is
the load's requests/s over the baseline's. Route decisions/s from the burst
(also ``route_speedup_vs_single_client``). Memory: resident set size of the
coordinator and of each worker process, before the baseline and after the
load, and their total every quarter of the load (``rss_trace_mb``); pools are
full before the first reading, so steady growth there means a leak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvmesh.arguments import non_negative_float, non_negative_int, positive_float, positive_int
from kvmesh.stats import percentile

PAGE_SIZE = 16
MiB = 1024 * 1024


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--clients", type=positive_int, default=8, help="concurrent clients in the load"
    )
    parser.add_argument("--duration", type=positive_float, default=20.0, help="seconds of load")
    parser.add_argument(
        "--baseline-duration",
        type=positive_float,
        default=None,
        help="seconds of the single-client baseline (default: half of --duration)",
    )
    parser.add_argument("--workers", type=positive_int, default=2, help="worker actors")
    parser.add_argument("--num-pages", type=positive_int, default=96, help="pages per worker pool")
    parser.add_argument(
        "--prefixes", type=positive_int, default=12, help="distinct shared prefixes"
    )
    parser.add_argument(
        "--prefix-pages", type=positive_int, default=4, help="full pages per prefix"
    )
    parser.add_argument(
        "--suffix-tokens", type=non_negative_int, default=24, help="random tokens after the prefix"
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=4, help="tokens generated per request"
    )
    parser.add_argument(
        "--warmup",
        type=non_negative_float,
        default=30.0,
        help="most seconds spent filling the pools",
    )
    parser.add_argument(
        "--warmup-cycles",
        type=non_negative_float,
        default=2.0,
        help="warm up until each worker has written every pool page this many times",
    )
    parser.add_argument(
        "--route-duration",
        type=positive_float,
        default=None,
        help="seconds per route burst (default 2)",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="prompt RNG seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True, slots=True)
class Spec:
    clients: int
    duration_s: float
    baseline_s: float
    workers: int
    num_pages: int
    prefixes: int
    prefix_pages: int
    suffix_tokens: int
    max_tokens: int
    warmup_s: float
    warmup_cycles: float
    route_s: float
    seed: int


@dataclass(frozen=True, slots=True)
class Phase:
    """What one phase measured (client side)."""

    clients: int
    seconds: float
    requests: int
    errors: int
    requests_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    error_kinds: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LoadFigures:
    """The JSON object `--json` prints."""

    clients: int
    workers: int
    duration_s: float
    requests: int
    requests_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    errors: int
    error_kinds: dict[str, int]
    baseline_requests_per_s: float
    baseline_latency_p50_ms: float
    baseline_latency_p99_ms: float
    baseline_errors: int
    speedup_vs_single_client: float
    route_decisions_per_s: float
    route_decisions_per_s_single: float
    route_speedup_vs_single_client: float
    route_errors: int
    rss_before_mb: float
    rss_after_mb: float
    rss_growth_mb: float
    rss_by_process_mb: dict[str, list[float]]
    rss_trace_mb: list[float]
    pool_cycles_before: float
    pool_cached_before: float
    page_hit_ratio: float
    pulled_pages: int
    warmup_s: float


def _check(spec: Spec) -> None:
    from kvmesh.errors import ConfigError

    problems = []
    if spec.clients < 1 or spec.workers < 1:
        problems.append("--clients and --workers must be >= 1")
    if spec.duration_s <= 0 or spec.baseline_s <= 0 or spec.route_s <= 0:
        problems.append("--duration, --baseline-duration and --route-duration must be > 0")
    if spec.warmup_s < 0 or spec.warmup_cycles < 0:
        problems.append("--warmup and --warmup-cycles must be >= 0")
    if spec.prefixes < 1 or spec.prefix_pages < 0 or spec.suffix_tokens < 1:
        problems.append("--prefixes and --suffix-tokens must be >= 1, --prefix-pages >= 0")
    if spec.max_tokens < 1:
        problems.append("--max-tokens must be >= 1")
    need = spec.prefix_pages + -(-spec.suffix_tokens // PAGE_SIZE)
    if spec.num_pages < 2 * need + 2:
        problems.append(
            f"--num-pages {spec.num_pages} is too small: one request needs {need} pages; "
            f"give at least {2 * need + 2}"
        )
    if problems:
        raise ConfigError("; ".join(problems))


# ------------------------------------------------------------------ processes


def rss_mb(pid: int) -> float:
    """Resident set size of process `pid` in MiB (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return float(psutil.Process(pid).memory_info().rss) / MiB
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MiB
    raise OSError(f"no VmRSS for process {pid}")


def _pids(mesh: Any) -> dict[str, int]:
    """Process ids of the coordinator actor and every worker actor (name -> pid)."""
    import ray

    out = {"coordinator": int(ray.get(mesh._coordinator.pid.remote(), timeout=60))}
    for w in mesh.workers():
        info = ray.get(mesh.worker(w["worker_id"]).info.remote(), timeout=60)
        out[w["worker_id"]] = int(info["pid"])
    return out


def _rss(pids: dict[str, int]) -> dict[str, float]:
    return {name: rss_mb(pid) for name, pid in pids.items()}


async def _sample_rss(pids: dict[str, int], every_s: float, out: list[float]) -> None:
    """Append the processes' total RSS now and every `every_s` until cancelled."""
    while True:
        out.append(sum(_rss(pids).values()))
        await asyncio.sleep(every_s)


# ------------------------------------------------------------------ load


class Prompts:
    """Shared prefixes plus random suffixes, from a seeded RNG (one per client)."""

    def __init__(self, spec: Spec, vocab: int) -> None:
        rng = random.Random(spec.seed)
        self.vocab = vocab
        self.suffix = spec.suffix_tokens
        self.prefixes = [
            [rng.randrange(vocab) for _ in range(spec.prefix_pages * PAGE_SIZE)]
            for _ in range(spec.prefixes)
        ]

    def draw(self, rng: random.Random) -> list[int]:
        prefix = self.prefixes[rng.randrange(len(self.prefixes))]
        return prefix + [rng.randrange(self.vocab) for _ in range(self.suffix)]


async def _drive(
    clients: int, seconds: float, call: Callable[[random.Random], Awaitable[Any]], seed: int
) -> Phase:
    """`clients` tasks loop over `call` until `seconds` have passed; the last calls finish."""
    latencies: list[float] = []
    kinds: dict[str, int] = {}
    deadline = time.perf_counter() + seconds

    async def client(i: int) -> None:
        rng = random.Random(seed * 1_000_003 + i)
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                await call(rng)
            except Exception as exc:  # counted, not raised: errors are a figure
                kinds[type(exc).__name__] = kinds.get(type(exc).__name__, 0) + 1
                continue
            latencies.append((time.perf_counter() - t0) * 1e3)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - t0
    errors = sum(kinds.values())
    return Phase(
        clients=clients,
        seconds=elapsed,
        requests=len(latencies),
        errors=errors,
        requests_per_s=len(latencies) / elapsed if elapsed > 0 else 0.0,
        latency_p50_ms=percentile(latencies, 50),
        latency_p99_ms=percentile(latencies, 99),
        error_kinds=kinds,
    )


async def _fill_pools(
    mesh: Any, spec: Spec, generate: Callable[..., Awaitable[Any]]
) -> tuple[float, float]:
    """Run the load until every worker has written each pool page `warmup_cycles` times.

    A page is written when it is computed or pulled into, and pages are taken
    from the free queue's head, so after ``num_pages`` writes every page of a
    pool has held KV. Returns (the fewest cycles, the smallest cached fraction)
    over workers when the pools are full or `warmup_s` is spent.
    """
    deadline = time.perf_counter() + spec.warmup_s
    round_no = 0
    while True:
        stats = await mesh.astats()
        cycles = min(
            ((w.pages_computed + w.pages_pulled) / w.num_pages for w in stats.workers),
            default=0.0,
        )
        cached = min((w.cached_pages / w.num_pages for w in stats.workers), default=0.0)
        if cycles >= spec.warmup_cycles or time.perf_counter() >= deadline:
            return cycles, cached
        round_no += 1
        step = min(1.0, max(0.05, deadline - time.perf_counter()))
        await _drive(spec.clients, step, generate, spec.seed + 7919 * round_no)


async def _measure(mesh: Any, spec: Spec) -> LoadFigures:
    prompts = Prompts(spec, mesh.config.model.vocab_size)

    async def generate(rng: random.Random) -> Any:
        return await mesh.agenerate(prompts.draw(rng), max_tokens=spec.max_tokens)

    async def route(rng: random.Random) -> Any:
        return await mesh.aroute(prompts.draw(rng))

    t0 = time.perf_counter()
    cycles, cached = await _fill_pools(mesh, spec, generate)
    warmup_s = time.perf_counter() - t0
    loop = asyncio.get_running_loop()
    pids = await loop.run_in_executor(None, _pids, mesh)
    before = _rss(pids)
    base = await _drive(1, spec.baseline_s, generate, spec.seed + 1)
    trace: list[float] = []
    sampler = asyncio.ensure_future(_sample_rss(pids, spec.duration_s / 4, trace))
    load = await _drive(spec.clients, spec.duration_s, generate, spec.seed + 2)
    sampler.cancel()
    after = _rss(pids)
    trace.append(sum(after.values()))
    route_one = await _drive(1, spec.route_s, route, spec.seed + 3)
    route_many = await _drive(spec.clients, spec.route_s, route, spec.seed + 4)
    stats = await mesh.astats()
    return LoadFigures(
        clients=spec.clients,
        workers=spec.workers,
        duration_s=load.seconds,
        requests=load.requests,
        requests_per_s=load.requests_per_s,
        latency_p50_ms=load.latency_p50_ms,
        latency_p99_ms=load.latency_p99_ms,
        errors=load.errors,
        error_kinds=load.error_kinds,
        baseline_requests_per_s=base.requests_per_s,
        baseline_latency_p50_ms=base.latency_p50_ms,
        baseline_latency_p99_ms=base.latency_p99_ms,
        baseline_errors=base.errors,
        speedup_vs_single_client=(
            load.requests_per_s / base.requests_per_s if base.requests_per_s else 0.0
        ),
        route_decisions_per_s=route_many.requests_per_s,
        route_decisions_per_s_single=route_one.requests_per_s,
        route_speedup_vs_single_client=(
            route_many.requests_per_s / route_one.requests_per_s
            if route_one.requests_per_s
            else 0.0
        ),
        route_errors=route_one.errors + route_many.errors,
        rss_before_mb=sum(before.values()),
        rss_after_mb=sum(after.values()),
        rss_growth_mb=sum(after.values()) - sum(before.values()),
        rss_by_process_mb={name: [before[name], after[name]] for name in pids},
        rss_trace_mb=trace,
        pool_cycles_before=cycles,
        pool_cached_before=cached,
        page_hit_ratio=stats.page_hit_ratio,
        pulled_pages=stats.pulled_pages,
        warmup_s=warmup_s,
    )


def measure(spec: Spec) -> LoadFigures:
    """Start the embedded cluster, run the phases, stop the cluster."""
    import dataclasses

    from kvmesh.app import connect
    from kvmesh.config import ClusterConfig, CoordinatorConfig, HashConfig, PoolConfig

    _check(spec)
    base = ClusterConfig()
    # Own namespace: never reuse (or disturb) the workers of another cluster in this Ray.
    ns = f"kvmesh-bench-load-{uuid.uuid4().hex[:8]}"
    cfg = dataclasses.replace(
        base,
        hash=HashConfig(page_size=PAGE_SIZE),
        pool=PoolConfig(num_pages=spec.num_pages),
        coordinator=CoordinatorConfig(namespace=ns, actor_name="kvmesh-coordinator"),
    )
    mesh = connect(
        num_workers=spec.workers,
        config=cfg,
        worker_max_concurrency=max(8, spec.clients + 2),
    )
    try:
        return asyncio.run(_measure(mesh, spec))
    finally:
        mesh.close()


def _table(fig: LoadFigures) -> str:
    lines = [
        f"kvmesh bench load: {fig.workers} workers; warm-up {fig.warmup_s:.1f}s wrote every "
        f"pool page {fig.pool_cycles_before:.1f}x (cached {fig.pool_cached_before:.0%})",
        "",
        f"{'phase':<22}{'req/s':>10}{'vs 1 client':>13}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}",
        f"{'1 client (baseline)':<22}{fig.baseline_requests_per_s:>10.1f}{1.0:>12.2f}x"
        f"{fig.baseline_latency_p50_ms:>10.1f}{fig.baseline_latency_p99_ms:>10.1f}"
        f"{fig.baseline_errors:>8}",
        f"{f'{fig.clients} clients':<22}{fig.requests_per_s:>10.1f}"
        f"{fig.speedup_vs_single_client:>12.2f}x"
        f"{fig.latency_p50_ms:>10.1f}{fig.latency_p99_ms:>10.1f}{fig.errors:>8}",
        "",
        f"route decisions/s: {fig.route_decisions_per_s_single:.0f} (1 client), "
        f"{fig.route_decisions_per_s:.0f} ({fig.clients} clients, "
        f"{fig.route_speedup_vs_single_client:.2f}x), errors {fig.route_errors}",
        f"page hit ratio {fig.page_hit_ratio:.2f}, pulled pages {fig.pulled_pages}",
        "",
        f"{'process':<16}{'RSS before MiB':>16}{'after MiB':>12}{'growth':>10}",
    ]
    for name, (b, a) in fig.rss_by_process_mb.items():
        lines.append(f"{name:<16}{b:>16.1f}{a:>12.1f}{a - b:>+10.1f}")
    lines.append(
        f"{'total':<16}{fig.rss_before_mb:>16.1f}{fig.rss_after_mb:>12.1f}{fig.rss_growth_mb:>+10.1f}"
    )
    lines.append(
        "total RSS during the load, every quarter (MiB): "
        + " ".join(f"{mb:.1f}" for mb in fig.rss_trace_mb)
    )
    if fig.error_kinds:
        lines.append(f"errors by kind: {fig.error_kinds}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvmesh.errors import KVMeshError

    spec = Spec(
        clients=args.clients,
        duration_s=args.duration,
        baseline_s=args.baseline_duration
        if args.baseline_duration is not None
        else args.duration / 2,
        workers=args.workers,
        num_pages=args.num_pages,
        prefixes=args.prefixes,
        prefix_pages=args.prefix_pages,
        suffix_tokens=args.suffix_tokens,
        max_tokens=args.max_tokens,
        warmup_s=args.warmup,
        warmup_cycles=args.warmup_cycles,
        route_s=args.route_duration if args.route_duration is not None else 2.0,
        seed=args.seed,
    )
    try:
        fig = measure(spec)
    except KVMeshError as exc:
        print(f"kvmesh bench load: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(fig)))
    else:
        print(_table(fig))
    return 0 if fig.errors == 0 else 1


__all__ = ["LoadFigures", "Phase", "Spec", "configure", "measure", "rss_mb", "run"]
