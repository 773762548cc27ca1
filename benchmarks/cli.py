"""`kvmesh bench ...`: each benchmark prints a ratio against a baseline measured in the same run."""

from __future__ import annotations

import argparse
import importlib

BENCHES: dict[str, tuple[str, str]] = {
    "pool": (
        "kvmesh.benchmarks.bench_pool",
        "page pool + cache manager trace replay, page hashing speed",
    ),
    "router": ("kvmesh.benchmarks.bench_router", "route decision latency and event ingestion rate"),
    "transfer": (
        "kvmesh.benchmarks.bench_transfer",
        "page transfer GB/s over gRPC and torch.distributed",
    ),
    "load": ("kvmesh.benchmarks.bench_load", "concurrent clients against the embedded cluster"),
    "tiers": (
        "kvmesh.benchmarks.bench_tiers",
        "promoting a page from host memory or disk vs recomputing it, ms per page",
    ),
    "capacity": (
        "kvmesh.benchmarks.bench_capacity",
        "the simulator: host tiers vs a large device pool, a quiet tenant beside a flood "
        "(LRU vs fair share)",
    ),
    "connector": (
        "kvmesh.benchmarks.bench_connector",
        "the KV connector's data path: save and load of an engine's blocks through its store, "
        "shared memory vs gRPC",
    ),
    "engines": (
        "kvmesh.benchmarks.bench_engines",
        "the gateway in front of two real vLLM CPU engines: kv_aware vs round_robin vs "
        "approx_prefix",
    ),
    "placement": (
        "kvmesh.benchmarks.engine_sim",
        "the gateway's routing in front of simulated engines (block pools publishing KV "
        "events, prefill queues in simulated time): hit rate, work and shares per policy",
    ),
}


def configure(parser: argparse.ArgumentParser) -> None:
    # the benchmarks' usage errors read like every other command's (kvmesh.app.cli)
    sub = parser.add_subparsers(
        dest="bench", metavar="BENCH", required=True, parser_class=type(parser)
    )
    for name, (module, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).configure(p)
        p.set_defaults(_bench_module=module)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._bench_module).run(args) or 0)
