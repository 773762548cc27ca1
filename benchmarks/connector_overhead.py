"""What kvmesh's KV connector costs a busy engine: one engine, no gateway, each connector role.

``python -m kvmesh.benchmarks.connector_overhead`` starts one real vLLM CPU
engine at a time, with the flags of ``kvmesh bench engines`` (pinned to one
core, 384 blocks), in each ``--variants`` setting:

- ``none``: no connector (the baseline every ratio is against);
- ``both``: the connector as ``kv_both`` with its store (shared memory);
- ``asking``: ``both`` with ``directory`` off: every claim asks the store
  (``Prepare``, waiting up to ``prepare_wait_ms``) and every load asks where
  its pages lie (``Locate``), as the connector did before the directory;
- ``consumer``: ``kv_consumer`` only (loads, never saves);
- ``producer``: ``kv_producer`` only (saves, never loads; it also waits for
  its saves before a step's output goes out, as a prefill engine must);
- ``grpc``: ``kv_both`` against a ``--no-shm`` store (blocks over gRPC).

and replays two workloads with ``--clients`` closed-loop clients: ``unique``
(``--prompts`` distinct prompts of 600-1000 tokens: every block is computed)
and ``shared`` (the second half of the prompts begins with most of a prompt of
the first half, by then evicted from the engine's 384 blocks: the connector
loads it from the store, an engine without it computes it again). It prints
mean / p50 / p90 TTFT per variant and workload with its ratio against
``none`` in the same run, the prompt tokens the engine computed and loaded
per request, and the connector's own wall time per hook (milliseconds a
request, from ``kvmesh_connector_hook_seconds``, which each engine process
writes into ``KVMESH_CONNECTOR_TIMINGS``: `kvmesh.connector.hook_timings`)
and how often ``get_num_new_matched_tokens`` answered "not yet" (vLLM skips
the request a step). Variants run in alternating order over ``--rounds``.
Engines start under the shared lock (``flock /tmp/kv/engines.lock ...``) on
the 2-core development machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.arguments import positive_int
from kvmesh.benchmarks.bench_engines import Replay, Turn, metric_sum, replay, reset_cache
from kvmesh.connector.engine_config import connector_config
from kvmesh.connector.hook_timings import HOOKS, TIMINGS_ENV
from kvmesh.connector.store_launcher import StoreProcess, engine_block_nbytes
from kvmesh.engine_launcher import EngineSpec, VLLMEngine, engine_model
from kvmesh.errors import ConfigError
from kvmesh.stats import percentile

BLOCK = 32
VOCAB = 1700  # token ids 3..1702: the tiny model's vocabulary is 1728
VARIANTS: dict[str, tuple[str | None, bool, bool]] = {
    # name: (kv_role or None for no connector, the store offers shared memory, directory)
    "none": (None, True, True),
    "both": ("kv_both", True, True),
    "asking": ("kv_both", True, False),
    "consumer": ("kv_consumer", True, True),
    "producer": ("kv_producer", True, True),
    "grpc": ("kv_both", False, True),
}
WORKLOADS = ("unique", "shared")
ANSWERS = ("direct", "read", "peers", "async", "in_time", "pending", "late", "timed_out", "failed")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=positive_int, default=48, help="requests per workload")
    parser.add_argument("--clients", type=positive_int, default=4, help="requests at once")
    parser.add_argument("--max-tokens", type=positive_int, default=4, help="tokens per answer")
    parser.add_argument("--rounds", type=positive_int, default=1, help="passes over the variants")
    parser.add_argument("--engine-blocks", type=positive_int, default=384, help="KV blocks")
    parser.add_argument("--store-blocks", type=positive_int, default=4096, help="store pages")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}"
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {list(WORKLOADS)}"
    )
    parser.add_argument("--seed", type=int, default=18, help="the prompts' random seed")
    parser.add_argument("--json", action="store_true", help="one JSON row per result instead")


def _names(text: str, known: Collection[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(f"--{what} {text!r}: choose from {list(known)}")
    return names


def prompts(workload: str, count: int, seed: int) -> list[Turn]:
    """`count` prompts of 600-1000 tokens; ``shared``: the second half each begins with 70 %
    of the prompt `count` // 2 earlier (by then out of the engine's cache)."""
    rng = random.Random(f"{workload}-{seed}")
    turns: list[Turn] = []
    for i in range(count):
        length = rng.randint(600, 1000)
        fresh = [3 + rng.randrange(VOCAB) for _ in range(length)]
        if workload == "shared" and i >= count // 2:
            head = list(turns[i - count // 2].prompt)
            head = head[: (len(head) * 7 // 10) // BLOCK * BLOCK]
            fresh = head + fresh[len(head) :]
        turns.append(Turn(i, tuple(fresh)))
    return turns


@dataclass(slots=True)
class Row:
    variant: str
    workload: str
    requests: int
    errors: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    computed_tokens: float  # prompt tokens the engine computed, per request
    loaded_tokens: float  # through the connector, per request
    hook_ms: dict[str, float] = field(default_factory=dict)  # per request
    hook_calls: dict[str, float] = field(default_factory=dict)  # per request
    answers: dict[str, float] = field(default_factory=dict)  # per request
    hook_cpu_ms: dict[str, float] = field(default_factory=dict)  # per request, its thread CPU
    engine_cpu_ms: float = 0.0  # CPU the engine's processes used, per request
    store_cpu_ms: float = 0.0  # CPU its store process used, per request
    ratio: float = 0.0  # mean TTFT / none's


def connector_samples(folder: Path) -> dict[tuple[str, str], float]:
    """(sample name, hook or answer) -> value, summed over every engine process's file."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for path in folder.glob("connector-*.prom"):
        try:
            text = path.read_text()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in ("kvmesh_connector_hook_seconds_sum",
                              "kvmesh_connector_hook_seconds_count",
                              "kvmesh_connector_hook_cpu_seconds_total"):  # fmt: skip
                    out[(s.name, s.labels["hook"])] += s.value
                elif s.name == "kvmesh_connector_prepare_answers_total":
                    out[(s.name, s.labels["answer"])] += s.value
    return out


ENGINE_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
)


def engine_counters(engine: VLLMEngine) -> dict[str, float]:
    text = httpx.get(engine.url + "/metrics", timeout=30).text
    return {name: metric_sum(text, name) for name in ENGINE_COUNTERS}


def cpu_s(pids: Collection[int]) -> float:
    """CPU seconds (user and system) the processes `pids` have used so far (/proc; gone: 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def group_pids(pgid: int) -> list[int]:
    """The processes of process group `pgid` (an engine: its API server, core and worker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


@dataclass(slots=True)
class Started:
    engine: VLLMEngine
    engine_pids: list[int]
    store_pids: list[int]

    def cpu(self) -> tuple[float, float]:
        return cpu_s(self.engine_pids), cpu_s(self.store_pids)


@contextmanager
def started(variant: str, spec: EngineSpec, args: argparse.Namespace) -> Iterator[Started]:
    """One engine (and its store, with the connector), stopped on exit."""
    role, shm, directory = VARIANTS[variant]
    store = None
    engine_spec = spec
    try:
        if role is not None:
            store = StoreProcess(
                block_nbytes=engine_block_nbytes(engine_model(), BLOCK),
                block_size=BLOCK,
                pages=args.store_blocks,
                hash_algo=spec.hash_algo,
                seed=spec.seed,
                name=f"store-{variant}",
                shm=shm,
            ).start()
            config = connector_config(
                store.page_address, store.control_address, role=role, directory=directory
            )
            engine_spec = replace(
                spec, extra_args=(*spec.extra_args, "--kv-transfer-config", config)
            )
        engine = VLLMEngine(engine_spec, name=f"engine-{variant}").start()
        try:
            engine_pids = group_pids(engine.process.pid) if engine.process else []
            store_pids = [store.process.pid] if store is not None and store.process else []
            yield Started(engine, engine_pids, store_pids)
        finally:
            engine.stop()
    finally:
        if store is not None:
            store.stop()


def measure_variant(
    variant: str, spec: EngineSpec, args: argparse.Namespace, timings: Path
) -> list[Row]:
    rows = []
    with started(variant, spec, args) as run:
        engine = run.engine
        asyncio.run(_warm(engine, args))
        for workload in _names(args.workloads, WORKLOADS, "workloads"):
            asyncio.run(_reset(engine))
            time.sleep(1.5)  # the processes' timing files catch up
            hooks0, counters0 = connector_samples(timings), engine_counters(engine)
            cpu0 = run.cpu()
            out = Replay()
            turns = prompts(workload, args.prompts, args.seed)
            asyncio.run(replay(engine.url, turns, args.clients, args.max_tokens, out))
            cpu1 = run.cpu()
            time.sleep(1.5)
            hooks1, counters1 = connector_samples(timings), engine_counters(engine)
            row = _row(variant, workload, out, hooks1, hooks0, counters1, counters0)
            n = max(1, len(out.ttfts))
            row.engine_cpu_ms = (cpu1[0] - cpu0[0]) * 1000 / n
            row.store_cpu_ms = (cpu1[1] - cpu0[1]) * 1000 / n
            rows.append(row)
            print(f"{variant} {workload}: mean TTFT {rows[-1].mean_ms:.1f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip
    return rows


async def _warm(engine: VLLMEngine, args: argparse.Namespace) -> None:
    warm = prompts("warm-up", 2, args.seed)
    out = Replay()
    await replay(engine.url, warm, 1, args.max_tokens, out)
    if out.errors:
        raise ConfigError(f"engine {engine.name} failed its warm-up: {out.first_error}")


async def _reset(engine: VLLMEngine) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        await reset_cache(client, engine)


def _row(
    variant: str,
    workload: str,
    out: Replay,
    hooks1: dict[tuple[str, str], float],
    hooks0: dict[tuple[str, str], float],
    counters1: dict[str, float],
    counters0: dict[str, float],
) -> Row:
    n = max(1, len(out.ttfts))
    ms = [t * 1000 for t in out.ttfts] or [0.0]
    delta = {k: counters1[k] - counters0[k] for k in counters1}
    hits = delta["vllm:prefix_cache_hits_total"] + delta["vllm:external_prefix_cache_hits_total"]

    def per_request(key: tuple[str, str], scale: float = 1.0) -> float:
        return (hooks1.get(key, 0.0) - hooks0.get(key, 0.0)) * scale / n

    return Row(
        variant,
        workload,
        len(out.ttfts),
        out.errors,
        sum(ms) / len(ms),
        percentile(ms, 50),
        percentile(ms, 90),
        (delta["vllm:prompt_tokens_total"] - hits) / n,
        delta["vllm:external_prefix_cache_hits_total"] / n,
        {h: per_request(("kvmesh_connector_hook_seconds_sum", h), 1000) for h in HOOKS},
        {h: per_request(("kvmesh_connector_hook_seconds_count", h)) for h in HOOKS},
        {a: per_request(("kvmesh_connector_prepare_answers_total", a)) for a in ANSWERS},
        {h: per_request(("kvmesh_connector_hook_cpu_seconds_total", h), 1000) for h in HOOKS},
    )


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    print(
        "| variant | workload | mean TTFT | x none | p50 | p90 | computed tok/req | loaded tok/req "
        "| hooks ms/req (matched, meta, load, save, send, prepare, pull) "
        "| their thread CPU ms/req | not-yet answers/req | CPU ms/req engine, store |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        hooks = ", ".join(f"{r.hook_ms[h]:.1f}" for h in HOOKS) if any(r.hook_ms.values()) else ""
        cpu = ", ".join(f"{r.hook_cpu_ms.get(h, 0.0):.1f}" for h in HOOKS) if hooks else ""
        pending = f"{r.answers['pending']:.2f}" if any(r.answers.values()) else ""
        print(
            f"| {r.variant} | {r.workload} | {r.mean_ms:.1f} ms | {r.ratio:.2f} | {r.p50_ms:.1f} "
            f"| {r.p90_ms:.1f} | {r.computed_tokens:.0f} | {r.loaded_tokens:.0f} | {hooks} "
            f"| {cpu} | {pending} | {r.engine_cpu_ms:.0f}, {r.store_cpu_ms:.0f} |"
            + (f" {r.errors} errors" if r.errors else "")
        )


def pooled(rows: list[Row]) -> list[Row]:
    """Rows of the same variant and workload over rounds, merged (means weighted by requests)."""
    by: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        by[(r.variant, r.workload)].append(r)
    out = []
    for (variant, workload), rs in by.items():
        n = sum(r.requests for r in rs) or 1

        def mean(get: object, rs: list[Row] = rs, n: int = n) -> float:
            return sum(get(r) * r.requests for r in rs) / n  # type: ignore[operator]

        out.append(Row(
            variant, workload, n, sum(r.errors for r in rs),
            mean(lambda r: r.mean_ms), mean(lambda r: r.p50_ms), mean(lambda r: r.p90_ms),
            mean(lambda r: r.computed_tokens), mean(lambda r: r.loaded_tokens),
            {h: mean(lambda r, h=h: r.hook_ms[h]) for h in HOOKS},
            {h: mean(lambda r, h=h: r.hook_calls[h]) for h in HOOKS},
            {a: mean(lambda r, a=a: r.answers[a]) for a in ANSWERS},
            {h: mean(lambda r, h=h: r.hook_cpu_ms.get(h, 0.0)) for h in HOOKS},
            mean(lambda r: r.engine_cpu_ms), mean(lambda r: r.store_cpu_ms),
        ))  # fmt: skip
    base = {r.workload: r.mean_ms for r in out if r.variant == "none"}
    for r in out:
        r.ratio = r.mean_ms / base[r.workload] if base.get(r.workload) else 0.0
    return out


def run(args: argparse.Namespace) -> int:
    variants = _names(args.variants, VARIANTS, "variants")
    _names(args.workloads, WORKLOADS, "workloads")
    nbytes = engine_block_nbytes(engine_model(), BLOCK)
    timings = Path(tempfile.mkdtemp(prefix="kvmesh-hook-timings-"))
    spec = EngineSpec(
        block_size=BLOCK,
        kv_cache_memory_bytes=args.engine_blocks * nbytes,
        max_model_len=4096,
        cpu_bind="0",  # one core, as each of bench engines' two engines
        extra_args=("--enable-prompt-tokens-details",),
        extra_env={TIMINGS_ENV: str(timings)},
    )
    load0 = os.getloadavg()
    rows: list[Row] = []
    for round_ in range(args.rounds):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            for old in timings.glob("*.prom"):
                old.unlink()  # a fresh engine's processes write new files
            rows += measure_variant(variant, spec, args, timings)
    load1 = os.getloadavg()
    merged = pooled(rows)
    if args.json:
        for r in merged:
            print(json.dumps(_as_dict(r)))
        return 0
    print_table(
        merged,
        f"one engine (core 0, {args.engine_blocks} blocks), {args.clients} clients, "
        f"{args.prompts} prompts of 600-1000 tokens per workload, {args.rounds} round(s); "
        f"load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end",
    )
    return 0


def _as_dict(r: Row) -> dict[str, object]:
    return {name: getattr(r, name) for name in Row.__slots__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    configure(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
