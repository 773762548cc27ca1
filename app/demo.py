"""`kvmesh demo`: the main job, on an embedded cluster, measured not modelled.

It starts a local Ray cluster with N workers (real torch model, real page
pools, real gRPC transfers), replays a slice of the bundled conversation trace
once per routing policy (`kv_aware`, then `round_robin`, with the workers'
pools emptied in between) and reports, per policy, what the workers measured:
page hit ratio, pages pulled from peers, TTFT (queue + pull + prefill) p50 /
p99 / mean, and requests per second. It prints a table, writes a PNG report
and says where; ``--json`` prints one JSON object per policy instead.

The slice: the trace's block ids are anonymised 512-token blocks of
multi-turn conversations whose later turns repeat the earlier ones. A
contiguous window of a few hundred requests holds almost no repeats (turns of
one conversation are minutes apart), so the demo takes the first ``--requests``
requests, in trace order, of the conversations with at least ``--min-turns``
turns (a conversation: requests sharing their first two blocks) and replays
them back to back. Lengths are scaled down so that a run fits in minutes on a
laptop: one trace block becomes ``--pages-per-block`` pages of 16 tokens
(deterministic tokens from `kvmesh.trace.block_tokens`), so the prefix
structure of the trace is kept exactly. The demo prints the slice's bound hit
ratio (one infinite shared cache) next to what each policy reached.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TimeElapsedColumn

from kvmesh.app.report import SHARED_ROWS, Row, plot_comparison, print_comparison
from kvmesh.arguments import non_negative_int, positive_int
from kvmesh.config import ClusterConfig, ModelConfig
from kvmesh.errors import ConfigError, KVMeshError
from kvmesh.requests import GenerationResult
from kvmesh.stats import mean, percentiles
from kvmesh.trace import TRACE_BLOCK_TOKENS, TraceRequest, block_tokens

if TYPE_CHECKING:
    from kvmesh.client import KVMesh

DEMO_MODEL = ModelConfig(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, ffn_dim=1024)
"""The demo's model: wide enough per token (~8 MFLOP) that prefill compute, not
per-request overhead, dominates TTFT on a CPU, as it does for a real LLM on a GPU."""

DEMO_POLICIES = ("kv_aware", "round_robin")


@dataclass(frozen=True, slots=True)
class TracePrompt:
    """One trace request as a real prompt: scaled token ids, answer length, arrival time."""

    token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float
    num_pages: int


def conversation_slice(reqs: Sequence[TraceRequest], min_turns: int) -> list[TraceRequest]:
    """Requests (in trace order) of conversations with at least `min_turns` turns.

    A conversation is the set of requests sharing their first two block ids
    (block 0 is the system prompt every request shares).
    """
    if min_turns < 1:
        raise ConfigError(f"--min-turns must be >= 1, got {min_turns}")
    turns: dict[tuple[int, ...], int] = defaultdict(int)
    for r in reqs:
        turns[r.hash_ids[:2]] += 1
    return [r for r in reqs if turns[r.hash_ids[:2]] >= min_turns]


def trace_prompts(
    reqs: Sequence[TraceRequest],
    cfg: ClusterConfig,
    pages_per_block: int = 1,
    max_tokens: int = 4,
) -> list[TracePrompt]:
    """Scale trace requests to prompts: one block -> `pages_per_block` pages of tokens.

    Input and output lengths scale by the same factor (tokens per block / 512);
    the answer is capped at `max_tokens`. Equal block ids give equal tokens, so
    the trace's shared prefixes become shared page hashes.
    """
    if pages_per_block < 1 or max_tokens < 1:
        raise ConfigError("pages_per_block and max_tokens must be >= 1")
    page = cfg.hash.page_size
    per_block = page * pages_per_block
    scale = per_block / TRACE_BLOCK_TOKENS
    vocab = cfg.model.vocab_size
    out: list[TracePrompt] = []
    t0 = reqs[0].timestamp_ms if reqs else 0
    for r in reqs:
        tokens: list[int] = []
        for b in r.hash_ids:
            tokens.extend(block_tokens(b, per_block, vocab))
        n = min(len(tokens), max(1, math.ceil(r.input_length * scale)))
        if not tokens:  # a request without blocks: one deterministic page
            tokens = block_tokens(0, page, vocab)
            n = len(tokens)
        answer = max(1, min(max_tokens, math.ceil(r.output_length * scale)))
        out.append(
            TracePrompt(tuple(tokens[:n]), answer, (r.timestamp_ms - t0) / 1000.0, n // page)
        )
    return out


def bound_hit_ratio(prompts: Sequence[TracePrompt], page_size: int) -> float:
    """Full pages whose whole prefix an earlier prompt had / all full pages (infinite cache)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for p in prompts:
        for i in range(p.num_pages):
            key = p.token_ids[: (i + 1) * page_size]
            total += 1
            if key in seen:
                hits += 1
            else:
                seen.add(key)
    return hits / total if total else 0.0


@dataclass(frozen=True, slots=True)
class ReplaySpec:
    """How requests are sent: at `time_scale` x their trace time (0: as soon as a slot is
    free), with at most `concurrency` in flight."""

    time_scale: float = 0.0
    concurrency: int = 2


@dataclass(frozen=True, slots=True)
class PolicyReport:
    """What one replay measured (TTFT as the workers measured it: queue + pull + prefill)."""

    policy: str
    requests: int
    errors: int
    prompt_pages: int
    page_hit_ratio: float
    pulled_pages: int
    reuse_ratio: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_mean_ms: float
    requests_per_s: float
    wall_s: float
    mismatches: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def replay(
    mesh: KVMesh,
    prompts: Sequence[TracePrompt],
    spec: ReplaySpec,
    *,
    label: str,
    console: Console | None = None,
    progress: bool = True,
) -> PolicyReport:
    """Send `prompts` through `mesh` as `spec` says and measure them.

    A request that fails with a `KVMeshError` counts as an error (and is not
    in the TTFT figures); any other exception propagates.
    """
    return asyncio.run(_replay(mesh, prompts, spec, label, console, progress))


async def _replay(
    mesh: KVMesh,
    prompts: Sequence[TracePrompt],
    spec: ReplaySpec,
    label: str,
    console: Console | None,
    show: bool,
) -> PolicyReport:

    before = (await mesh.astats()).mismatches
    sem = asyncio.Semaphore(spec.concurrency)
    results: list[GenerationResult] = []
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not show,
        transient=True,
    )

    async def one(p: TracePrompt, task: TaskID) -> None:
        nonlocal errors
        if spec.time_scale > 0:
            delay = start + p.arrival_s * spec.time_scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        async with sem:
            t = time.perf_counter()
            try:
                res = await mesh.agenerate(list(p.token_ids), max_tokens=p.max_tokens)
            except KVMeshError:
                errors += 1
            else:
                results.append(res)
                latencies.append((time.perf_counter() - t) * 1000.0)
            bar.advance(task)

    with bar:
        task = bar.add_task(f"replay {label}", total=len(prompts))
        if spec.time_scale > 0:
            await asyncio.gather(*(one(p, task) for p in prompts))
        else:  # back to back: a fixed set of senders keeps trace order within each slot
            queue = list(reversed(prompts))

            async def sender() -> None:
                while queue:
                    await one(queue.pop(), task)

            await asyncio.gather(*(sender() for _ in range(spec.concurrency)))
    wall = time.perf_counter() - start
    pages = sum(r.pages_hit_local + r.pages_pulled + r.pages_computed for r in results)
    hits = sum(r.pages_hit_local for r in results)
    pulled = sum(r.pages_pulled for r in results)
    ttfts = [r.timings.ttft_ms for r in results]
    p50, p99 = percentiles(ttfts, (50, 99))
    return PolicyReport(
        policy=label,
        requests=len(results),
        errors=errors,
        prompt_pages=pages,
        page_hit_ratio=hits / pages if pages else 0.0,
        pulled_pages=pulled,
        reuse_ratio=(hits + pulled) / pages if pages else 0.0,
        ttft_mean_ms=mean(ttfts),
        ttft_p50_ms=p50,
        ttft_p99_ms=p99,
        latency_mean_ms=mean(latencies),
        requests_per_s=len(results) / wall if wall > 0 else 0.0,
        wall_s=wall,
        mismatches=(await mesh.astats()).mismatches - before,
    )


DEMO_ROWS: tuple[Row, ...] = (
    Row("requests", "requests"),
    Row("errors", "errors"),
    *SHARED_ROWS,
    Row("latency mean (ms, client)", "latency_mean_ms", "{:.1f}"),
    Row("requests / s", "requests_per_s", "{:.2f}"),
    Row("predicted/realized mismatches", "mismatches"),
)
"""The table's rows: the demo's counts, the figures the simulator shows too, its own."""


def print_reports(reports: Sequence[PolicyReport], console: Console | None = None) -> None:
    """The demo's table (`kvmesh.app.report`): a row per figure, a column per policy."""
    print_comparison(reports, DEMO_ROWS, "kvmesh: measured per routing policy", console)


# -- the command ---------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=positive_int, default=4, help="worker actors (default 4)")
    parser.add_argument(
        "--requests", type=positive_int, default=200, help="requests of the trace slice per policy"
    )
    parser.add_argument(
        "--min-turns",
        type=non_negative_int,
        default=10,
        help="slice: conversations with at least this many turns",
    )
    parser.add_argument(
        "--pages-per-block", type=positive_int, default=2, help="pages of 16 tokens per trace block"
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=4, help="cap on tokens per answer"
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=1,
        help="requests in flight (default 1: TTFT is then the prefill work a policy leaves, "
        "not CPU contention on a small machine)",
    )
    parser.add_argument(
        "--pull",
        action="store_true",
        help="let workers pull prefix pages a peer holds (every policy) instead of computing them",
    )
    parser.add_argument(
        "--transport",
        choices=("grpc", "dist"),
        default="grpc",
        help="with --pull: move pulled pages over gRPC (default) or torch.distributed links",
    )
    parser.add_argument(
        "--policies",
        default=",".join(DEMO_POLICIES),
        help="comma-separated routing policies to compare (default: kv_aware,round_robin)",
    )
    parser.add_argument(
        "--num-pages", type=positive_int, default=4096, help="pages per worker pool"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per policy")
    parser.add_argument(
        "--address",
        default=None,
        help="run against the workers of this Ray cluster (they keep their own model) "
        "instead of an embedded one",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path("kvmesh-report.png"),
        help="where to write the PNG report (default ./kvmesh-report.png)",
    )


def _check(args: argparse.Namespace) -> list[str]:
    for flag in ("workers", "requests", "pages_per_block", "max_tokens", "concurrency"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_pages < 2:
        raise ConfigError(f"--num-pages must be >= 2, got {args.num_pages}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError("--policies names no policy")
    from kvmesh.coordinator.policies import REGISTRY

    unknown = [p for p in policies if p not in REGISTRY]
    if unknown:
        raise ConfigError(f"unknown policies {unknown}; choose from {sorted(REGISTRY)}")
    return policies


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    policies = _check(args)
    from kvmesh.app.commands import _console, transfer_summary
    from kvmesh.app.embedded import connect
    from kvmesh.settings import load_cluster_config
    from kvmesh.trace import load_trace

    console = _console(stderr=args.json)
    # The KVMESH_* settings as every entry point reads them, the demo's model shape and
    # these flags over them.
    shape = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim")
    flags = {
        "num_workers": args.workers,
        "pool.num_pages": args.num_pages,
        "transfer.transport": args.transport,
    }
    cfg = load_cluster_config(
        {**flags, **{f"model.{name}": getattr(DEMO_MODEL, name) for name in shape}},
        names={"num_workers": "--workers", "pool.num_pages": "--num-pages"},
    )
    reqs = conversation_slice(load_trace(), args.min_turns)[: args.requests]
    if not reqs:
        raise ConfigError(f"no conversation in the trace has {args.min_turns} turns")
    prompts = trace_prompts(reqs, cfg, args.pages_per_block, args.max_tokens)
    bound = bound_hit_ratio(prompts, cfg.hash.page_size)
    console.print(
        f"trace slice: {len(prompts)} requests of conversations with >= {args.min_turns} turns, "
        f"{sum(p.num_pages for p in prompts)} prompt pages, bound hit ratio {bound:.3f}",
        highlight=False,
    )
    t0 = time.perf_counter()
    reports: list[PolicyReport] = []
    with connect(args.address, num_workers=args.workers, config=cfg, pull=args.pull) as mesh:
        num_workers = len(mesh.workers())
        where = "embedded cluster" if args.address is None else f"cluster at {args.address}"
        console.print(
            f"{where} up in {time.perf_counter() - t0:.1f}s: {len(mesh.workers())} workers",
            highlight=False,
        )
        for policy in policies:
            mesh.reset(policy=policy)
            report = replay(
                mesh,
                prompts,
                ReplaySpec(concurrency=args.concurrency),
                label=policy,
                console=console,
                progress=not args.json,
            )
            reports.append(report)
            moved = transfer_summary(mesh.stats())
            if moved and not args.json:
                console.print(f"{policy} {moved}", highlight=False)
            if args.json:
                print(json.dumps(report.to_dict()), flush=True)
    if not args.json:
        print_reports(reports, console)
    by_name = {r.policy: r for r in reports}
    summary = ""
    kv, rr = by_name.get("kv_aware"), by_name.get("round_robin")
    if kv is not None and rr is not None and kv.ttft_mean_ms > 0 and kv.ttft_p99_ms > 0:
        summary = (
            f"mean TTFT round_robin / kv_aware = {rr.ttft_mean_ms / kv.ttft_mean_ms:.2f}x "
            f"(p50 {rr.ttft_p50_ms / max(kv.ttft_p50_ms, 1e-9):.2f}x, "
            f"p99 {rr.ttft_p99_ms / kv.ttft_p99_ms:.2f}x)"
        )
        console.print(summary, highlight=False)
    path = plot_comparison(
        reports,
        args.plot,
        f"kvmesh demo: {len(prompts)} trace requests, {num_workers} workers"
        + (f"\n{summary}" if summary else ""),
        own=Row("requests / s", "requests_per_s"),
        bound=bound,
    )
    console.print(f"report written to {path.resolve()}", highlight=False, soft_wrap=True)
    console.print(f"demo took {time.perf_counter() - started:.1f}s in all", highlight=False)
    return 0
