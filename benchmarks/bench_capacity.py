"""`kvmesh bench capacity`: what host tiers and tenant fair shares buy, on a trace, in one run.

Both sides of every ratio come from this run's simulations (`kvmesh simulate`'s
engine: real pools, tiers, index and kv_aware; modelled time):

- tiers: a small device pool plus host pages against a device pool as large
  as both (reuse ratio and mean TTFT), with the small device pool alone beside;
- tenants: the trace's tenant alone, then beside a neighbour flooding unique
  prompts, under plain LRU and under fair-share eviction: the trace tenant's
  page hit ratio, and each against its ratio alone.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from kvmesh.app.sim_engine import (
    QUIET_TENANT,
    PreparedTrace,
    SimSettings,
    TimeModel,
    prepare_trace,
)
from kvmesh.app.simulate import PolicyReport, simulate
from kvmesh.arguments import non_negative_float, non_negative_int, positive_float, positive_int
from kvmesh.config import CoordinatorConfig
from kvmesh.errors import ConfigError
from kvmesh.trace import load_trace

POLICY = "kv_aware"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", default="bundled", help="trace file or 'bundled'")
    parser.add_argument("--workers", type=positive_int, default=8)
    parser.add_argument(
        "--capacity-pages", type=positive_int, default=2000, help="device pages per worker"
    )
    parser.add_argument(
        "--host-pages", type=non_negative_int, default=16000, help="host pages per worker"
    )
    parser.add_argument(
        "--flood",
        type=non_negative_float,
        default=2,
        help="the neighbour's unique prompts per trace request",
    )
    parser.add_argument("--limit", type=positive_int, help="replay only the first N requests")
    parser.add_argument("--part", choices=("all", "tiers", "tenants"), default="all")
    parser.add_argument(
        "--quiet-weight",
        type=positive_float,
        default=1.0,
        help="the trace tenant's fair-share weight (the flooding one weighs 1)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object with every figure")


def _run(trace: PreparedTrace, settings: SimSettings) -> PolicyReport:
    costs = settings.time.tier_costs(settings.page_size)
    config = CoordinatorConfig(host_hit_cost=costs.host, disk_hit_cost=costs.disk)
    return simulate(trace, POLICY, settings, config)


def tiers(trace: PreparedTrace, args: argparse.Namespace) -> dict[str, Any]:
    """Small device pool + host pages against a device pool of both sizes together."""
    small = SimSettings(args.workers, args.capacity_pages)
    runs = {
        "device_small": _run(trace, small),
        "tiered": _run(trace, replace(small, host_pages=args.host_pages)),
        "device_large": _run(
            trace, replace(small, capacity_pages=args.capacity_pages + args.host_pages)
        ),
    }
    large = runs["device_large"]
    out: dict[str, Any] = {
        name: {"reuse_ratio": r.reuse_ratio, "ttft_mean_ms": r.ttft_mean_ms}
        for name, r in runs.items()
    }
    out["reuse_vs_large"] = runs["tiered"].reuse_ratio / large.reuse_ratio
    out["ttft_vs_large"] = runs["tiered"].ttft_mean_ms / large.ttft_mean_ms
    return out


def tenants(trace: PreparedTrace, args: argparse.Namespace) -> dict[str, Any]:
    """The trace tenant's page hit ratio alone, and beside a flood under LRU and fair share.

    With the flood, every modelled time is divided by (1 + flood) (prefill, decode,
    promotions, pulls), as a cluster sized for the load would run: the queues and the
    weighing of a host hit against a recompute stay as they were alone, so the ratios
    compare what the caches keep, not routing under overload.
    """
    settings = SimSettings(
        args.workers,
        args.capacity_pages,
        host_pages=args.host_pages,
        tenant_weights=f"{QUIET_TENANT}={args.quiet_weight}",
    )
    alone = _run(trace, settings).page_hit_ratio
    flooded = trace.with_flood(args.flood)
    scale = 1.0 + args.flood
    tm = settings.time
    sized = replace(
        settings, time=TimeModel(*(getattr(tm, f.name) / scale for f in fields(TimeModel)))
    )
    out: dict[str, Any] = {
        "alone": alone,
        "flood_per_request": args.flood,
        "quiet_weight": args.quiet_weight,
    }
    for eviction in ("lru", "fair"):
        report = _run(flooded, replace(sized, eviction=eviction))
        ratio = report.tenant_page_hit_ratio[QUIET_TENANT]
        out[eviction] = {"hit_ratio": ratio, "vs_alone": ratio / alone if alone else 0.0}
    return out


def run(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {args.limit}")
    path = None if args.trace in (None, "", "bundled") else Path(args.trace)
    trace = prepare_trace(load_trace(path, args.limit))
    figures: dict[str, Any] = {}
    if args.part in ("all", "tiers"):
        figures["tiers"] = t = tiers(trace, args)
        if not args.json:
            print(f"tiers ({args.workers} workers, {len(trace.requests)} requests, {POLICY}):")
            for name, label in (
                ("device_small", f"device {args.capacity_pages}"),
                ("tiered", f"device {args.capacity_pages} + host {args.host_pages}"),
                ("device_large", f"device {args.capacity_pages + args.host_pages}"),
            ):
                r = t[name]
                print(
                    f"  {label:<28} reuse {r['reuse_ratio']:.4f}   "
                    f"TTFT mean {r['ttft_mean_ms']:.1f} ms"
                )
            print(f"  reuse, tiered / large device: {t['reuse_vs_large']:.3f} (goal >= 0.95)")
            print(f"  TTFT mean, tiered / large device: {t['ttft_vs_large']:.3f} (goal <= 1.15)")
    if args.part in ("all", "tenants"):
        figures["tenants"] = n = tenants(trace, args)
        if not args.json:
            print(
                f"tenants (the trace's tenant beside one sending {args.flood} unique prompts "
                f"per request; with it, every modelled time / {1 + args.flood}; "
                f"its weight {args.quiet_weight}, the neighbour's 1):"
            )
            print(f"  alone                 page hit ratio {n['alone']:.4f}")
            for eviction in ("lru", "fair"):
                r = n[eviction]
                print(
                    f"  beside it, {eviction:<5}      page hit ratio {r['hit_ratio']:.4f}   "
                    f"{r['vs_alone']:.3f} x alone"
                )
            print("  goal: fair >= 0.9 x alone")
    if args.json:
        print(json.dumps(figures))
    return 0
