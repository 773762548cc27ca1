"""`kvmesh simulate`: replay a trace offline against simulated workers and routing policies.

The replay is `kvmesh.app.sim_engine`'s (real pools, cache managers, index and
policies; modelled time); this module is the command around it: the flags,
one replay per policy, the figures of each (`summarize`) and their table,
JSON lines and plot (`kvmesh.app.report`, shared with the demo).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.app.report import SHARED_ROWS, Row, plot_comparison, print_comparison
from kvmesh.app.sim_engine import (
    FLOOD_TENANT,
    QUIET_TENANT,
    PreparedTrace,
    SimResult,
    SimSettings,
    Simulation,
    TimeModel,
    prepare_trace,
)
from kvmesh.arguments import non_negative_float, non_negative_int, positive_int
from kvmesh.config import CoordinatorConfig, from_env
from kvmesh.coordinator.policies import REGISTRY, make_policy
from kvmesh.errors import ConfigError
from kvmesh.stats import mean, percentiles
from kvmesh.trace import TRACE_BLOCK_TOKENS, load_trace

REPORT_KEYS: tuple[str, ...] = (
    "policy",
    "page_hit_ratio",
    "pulled_pages",
    "reuse_ratio",
    "token_hit_ratio",
    "bound_hit_ratio",
    "load_imbalance",
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "route_ms_mean",
)
"""The keys of one `--json` line, in order."""

SIM_ROWS: tuple[Row, ...] = (
    *SHARED_ROWS,
    Row("token hit ratio", "token_hit_ratio", "{:.3f}"),
    Row("bound hit ratio (infinite cache)", "bound_hit_ratio", "{:.3f}"),
    Row("load imbalance (max / mean busy)", "load_imbalance", "{:.3f}"),
    Row("route ms (mean, wall)", "route_ms_mean", "{:.3f}"),
)
"""The table's rows: the figures the demo shows too, then the simulator's own."""


@dataclass(frozen=True, slots=True)
class PolicyReport:
    """One policy's figures; `as_json` has exactly `REPORT_KEYS`, and
    ``tenant_page_hit_ratio`` (tenant -> its page hit ratio) when several tenants ran."""

    policy: str
    page_hit_ratio: float
    pulled_pages: int
    reuse_ratio: float
    token_hit_ratio: float
    bound_hit_ratio: float
    load_imbalance: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    route_ms_mean: float
    tenant_page_hit_ratio: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        if len(self.tenant_page_hit_ratio) < 2:
            del out["tenant_page_hit_ratio"]
        return out


def summarize(result: SimResult, page_size: int = TRACE_BLOCK_TOKENS) -> PolicyReport:
    """The figures of one replay."""
    timings = result.timings
    pages = sum(t.num_pages for t in timings) or 1
    hits = sum(t.hit_pages for t in timings)
    pulled = sum(t.pulled_pages for t in timings)
    ttft = [t.ttft_ms for t in timings]
    busy = result.busy_ms
    mean_busy = mean(busy)
    p50, p99 = percentiles(ttft, (50, 99))
    tenant_pages: Counter[str] = Counter()
    tenant_hits: Counter[str] = Counter()
    for t in timings:
        tenant_pages[t.tenant] += t.num_pages
        tenant_hits[t.tenant] += t.hit_pages
    return PolicyReport(
        policy=result.policy,
        page_hit_ratio=hits / pages,
        pulled_pages=pulled,
        reuse_ratio=(hits + pulled) / pages,
        token_hit_ratio=hits * page_size / result.total_tokens if result.total_tokens else 0.0,
        bound_hit_ratio=result.bound_hit_ratio,
        load_imbalance=max(busy) / mean_busy if mean_busy > 0 else 1.0,
        ttft_mean_ms=mean(ttft),
        ttft_p50_ms=p50,
        ttft_p99_ms=p99,
        route_ms_mean=result.route_s * 1000.0 / len(timings) if timings else 0.0,
        tenant_page_hit_ratio={t: tenant_hits[t] / n for t, n in sorted(tenant_pages.items()) if n},
    )


def simulate(
    trace: PreparedTrace,
    policy: str,
    settings: SimSettings,
    config: CoordinatorConfig | None = None,
    *,
    timer: Callable[[], float] = time.perf_counter,
) -> PolicyReport:
    """Replay `trace` under the registered `policy` and summarize it."""
    cfg = config or CoordinatorConfig()
    sim = Simulation(
        trace, make_policy(policy, cfg, random.Random(cfg.seed)), settings, timer=timer
    )
    return summarize(sim.run(), settings.page_size)


def policy_names(spec: str) -> list[str]:
    """`all` or a comma-separated list of registered policy names."""
    if spec == "all":
        return list(REGISTRY)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown or not names:
        raise ConfigError(
            f"unknown routing policy {', '.join(unknown) or spec!r}; "
            f"choose 'all' or some of {', '.join(REGISTRY)}"
        )
    return names


# ------------------------------------------------------------------------- CLI


def configure(parser: argparse.ArgumentParser) -> None:
    tm = TimeModel()
    parser.add_argument(
        "trace",
        nargs="?",
        default="bundled",
        metavar="TRACE",
        help="Mooncake-format JSONL(.gz) trace, or 'bundled' (default): the conversation trace",
    )
    parser.add_argument(
        "--workers", type=positive_int, default=8, help="simulated workers (default 8)"
    )
    parser.add_argument(
        "--capacity-pages",
        type=positive_int,
        default=10_000,
        help="pages of 512 tokens per worker (default 10000)",
    )
    parser.add_argument(
        "--policy",
        default="all",
        help=f"'all' (default) or comma-separated names: {', '.join(REGISTRY)}",
    )
    parser.add_argument(
        "--pull",
        action="store_true",
        help="workers pull the pages a peer holds instead of computing",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per policy per line")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="write a comparison PNG")
    parser.add_argument("--limit", type=positive_int, help="replay only the first N requests")
    parser.add_argument(
        "--seed", type=non_negative_int, help="routing RNG seed (default: CoordinatorConfig)"
    )
    parser.add_argument(
        "--overlap-weight", type=non_negative_float, help="kv_aware weight of pages to prefill"
    )
    parser.add_argument(
        "--decode-weight", type=non_negative_float, help="kv_aware weight of decode pages"
    )
    parser.add_argument(
        "--queue-weight", type=non_negative_float, help="kv_aware weight of queued prefill pages"
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        help="kv_aware softmax sampling temperature (0: argmin)",
    )
    parser.add_argument(
        "--max-load-ratio", type=non_negative_float, help="kv_aware bounded load (0: off)"
    )
    t = parser.add_argument_group("tiers and tenants (the workers' real TieredCache)")
    t.add_argument(
        "--host-pages",
        type=non_negative_int,
        default=0,
        help="host-memory pages per worker (default 0: none)",
    )
    t.add_argument(
        "--disk-pages",
        type=non_negative_int,
        default=0,
        help="disk pages per worker, real page files in a temporary folder (default 0: none)",
    )
    t.add_argument(
        "--eviction",
        choices=("lru", "fair"),
        default="lru",
        help="who loses pages in a full pool or tier: lru, or fair (tenants above their share)",
    )
    t.add_argument(
        "--tenant-weights",
        default="",
        help=f"fair shares: 'tenant=weight,...'; with --flood the trace's tenant is "
        f"{QUIET_TENANT}, the neighbour {FLOOD_TENANT}",
    )
    t.add_argument(
        "--flood",
        type=non_negative_float,
        default=0.0,
        metavar="N",
        help="tenant mix: the trace is one tenant's, beside a neighbour sending N unique "
        "prompts of the same length per request of it, 0.5: one every other request "
        "(default 0: the trace alone)",
    )
    t.add_argument(
        "--host-hit-cost",
        type=non_negative_float,
        help="kv_aware cost of a host hit per page, as a fraction of a recompute "
        "(default: host-page-ms / a page's prefill time)",
    )
    t.add_argument(
        "--disk-hit-cost",
        type=non_negative_float,
        help="kv_aware cost of a disk hit per page (default: disk-page-ms / a page's prefill time)",
    )
    g = parser.add_argument_group("time model")
    g.add_argument("--prefill-base-ms", type=non_negative_float, default=tm.prefill_base_ms)
    g.add_argument("--prefill-token-us", type=non_negative_float, default=tm.prefill_token_us)
    g.add_argument("--decode-token-ms", type=non_negative_float, default=tm.decode_token_ms)
    g.add_argument("--pull-page-ms", type=non_negative_float, default=tm.pull_page_ms)
    g.add_argument("--host-page-ms", type=non_negative_float, default=tm.host_page_ms)
    g.add_argument("--disk-page-ms", type=non_negative_float, default=tm.disk_page_ms)


def settings_from_args(args: argparse.Namespace) -> tuple[SimSettings, CoordinatorConfig]:
    """The simulation settings and coordinator config the flags ask for."""
    tm = TimeModel(
        args.prefill_base_ms,
        args.prefill_token_us,
        args.decode_token_ms,
        args.pull_page_ms,
        args.host_page_ms,
        args.disk_page_ms,
    )
    settings = SimSettings(
        args.workers,
        args.capacity_pages,
        args.pull,
        tm,
        host_pages=args.host_pages,
        disk_pages=args.disk_pages,
        eviction=args.eviction,
        tenant_weights=args.tenant_weights,
    )
    # kv_aware weighs a lower tier's hit by what the time model charges for it
    costs = tm.tier_costs(settings.page_size)
    host = args.host_hit_cost if args.host_hit_cost is not None else costs.host
    disk = args.disk_hit_cost if args.disk_hit_cost is not None else costs.disk
    config = from_env(
        CoordinatorConfig,
        seed=args.seed,
        overlap_weight=args.overlap_weight,
        decode_weight=args.decode_weight,
        queue_weight=args.queue_weight,
        temperature=args.temperature,
        max_load_ratio=args.max_load_ratio,
        host_hit_cost=host,
        disk_hit_cost=disk,
        tenant_weights=args.tenant_weights or None,
    )
    return settings, config


def run(args: argparse.Namespace) -> int:
    settings, config = settings_from_args(args)
    names = policy_names(args.policy)
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {args.limit}")
    path = None if args.trace in (None, "", "bundled") else Path(args.trace)
    trace = prepare_trace(load_trace(path, args.limit), settings.page_size)
    if args.flood:
        trace = trace.with_flood(args.flood)
    reports: list[PolicyReport] = []
    for name in names:
        report = simulate(trace, name, settings, config)
        reports.append(report)
        if args.json:
            print(json.dumps(report.as_json()), flush=True)
    heading = (
        f"{len(trace.requests)} requests, {settings.workers} workers x "
        f"{settings.capacity_pages} pages{', pulls' if settings.pull else ''}"
        f"{f' + {settings.host_pages} host' if settings.host_pages else ''}"
        f"{f' + {settings.disk_pages} disk' if settings.disk_pages else ''}"
        f"{f', {args.flood} flooding per request, {settings.eviction} eviction' if args.flood else ''}"
    )
    if not args.json:
        print_comparison(reports, SIM_ROWS, heading)
        for r in reports:
            if len(r.tenant_page_hit_ratio) > 1:
                each = ", ".join(f"{t} {v:.3f}" for t, v in r.tenant_page_hit_ratio.items())
                print(f"{r.policy}: page hit ratio by tenant: {each}")
    if args.plot is not None:
        plot_comparison(
            reports,
            args.plot,
            heading,
            own=Row("load imbalance (max / mean busy)", "load_imbalance"),
            own_line=1.0,
            bound=reports[0].bound_hit_ratio,
        )
        if not args.json:
            print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


__all__ = [
    "REPORT_KEYS",
    "SIM_ROWS",
    "PolicyReport",
    "configure",
    "policy_names",
    "run",
    "settings_from_args",
    "simulate",
    "summarize",
]
