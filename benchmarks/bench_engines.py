"""`kvmesh bench engines`: the gateway in front of two real vLLM CPU engines, per policy.

A slice of the bundled conversation trace (conversations of at least
``--min-turns`` turns, ``--requests`` requests in all, each trace block as
``--block-tokens`` token ids, which is the engines' block size; which
requests and how long, ``--slice`` and ``--full-blocks``:
`kvmesh.benchmarks.engine_slices`) is replayed
through ``kvmesh gateway`` once per policy, in the same run and against the
same two engines, whose prefix caches are reset (``/reset_prefix_cache``)
before each policy:

- ``kv_aware``: routes on the index the engines' own KV events build;
- ``round_robin``: the baseline that ignores caches;
- ``approx_prefix``: sees no events; routes from its own routing history,
  assuming each engine keeps as many blocks as it really has.

``--concurrency`` clients send the slice's requests in trace order (a turn
waits until its conversation's previous turn was answered), streaming; the
time to the first SSE chunk is the request's TTFT (client side). Figures per policy: TTFT mean/p50/p99,
requests/s, each engine's own prefix-cache hit rate from its ``/metrics``
(``vllm:prefix_cache_hits`` / ``queries``, in tokens) and the slice's bound
(one infinite shared cache). The engines run from ``.venv-engine``
(`scripts/setup-engine-venv.sh`), pinned to one core each.

``--gateways N`` runs each policy behind N gateway replicas, request ``i``
sent to replica ``i % N`` (a load balancer in front of replicated routers
knows no conversations). The replicas of an event-fed policy read the same
engine events; each ``approx_prefix`` replica knows only what it routed
itself, which is where reading the engines' caches and keeping a history
part ways: with one gateway that knows the engines' capacity, the history
is the cache (docs/engines.md).

``--connector`` adds, in the same run, ``kv_mesh`` (`kv_aware` with pulls
through the mesh in its cost: route + pull + recompute) and ``round_robin`` on
two engines that load kvmesh's KV connector (`kvmesh.connector`), each with
a kvmesh store beside it whose peer is the other's store, so both engines
act as one cache: what one computed, the other loads. Their stores are
emptied (restarted) before each policy. Rows say ``connector`` and
``engine_external_hit_rate`` (prompt tokens loaded through the connector,
``vllm:external_prefix_cache_hits``, over the engines' prefix-cache
queries); reuse is the local and the external hit rate together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import httpx

from kvmesh.arguments import non_negative_int, positive_float, positive_int
from kvmesh.benchmarks import engine_decisions
from kvmesh.benchmarks.engine_slices import (
    SLICES,
    cache_replays,
    prompt_tokens,
    slice_prompts,
    slices_table,
    trace_slice,
)
from kvmesh.config import CoordinatorConfig
from kvmesh.connector.engine_config import connector_config
from kvmesh.connector.store_launcher import StoreProcess, engine_block_nbytes
from kvmesh.engine_launcher import (
    REPO_ROOT,
    EngineSpec,
    VLLMEngine,
    engine_model,
    free_port,
    local_endpoint,
    process_tree,
)
from kvmesh.errors import ConfigError, DeadlineExceeded, TransportError
from kvmesh.gateway.config import HISTORY_POLICY
from kvmesh.gateway.decisions import DECISION_HEADER
from kvmesh.gateway.tokenizer import PromptTokenizer
from kvmesh.stats import percentile
from kvmesh.trace import TraceRequest, blocks_tokens, load_trace

POLICIES = ("kv_aware", "round_robin", "approx_prefix")
ARRIVALS = ("closed", "trace")
DEFAULT_LOAD = 0.8
"""The trace's arrivals at 0.8 of round robin's closed-loop throughput: busy, as a cluster is
that a cache router is worth having for, yet below round robin's saturation."""
CONNECTOR_POLICIES = ("kv_mesh", "round_robin")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=positive_int, default=250, help="requests in the slice")
    parser.add_argument(
        "--min-turns",
        type=non_negative_int,
        default=8,
        help="conversations of at least this many turns",
    )
    parser.add_argument(
        "--slice",
        choices=SLICES,
        default=SLICES[0],
        help="which requests of those conversations: the first that fit the context "
        "(default), the first of conversations whose every prompt fits (the slice before), "
        "or every turn of the first conversations (docs/engines.md)",
    )
    parser.add_argument(
        "--full-blocks",
        action="store_true",
        help="every trace block a full block (the slice before); default: the trace's "
        "input_length scaled, so a prompt's last block is partial as in the trace",
    )
    parser.add_argument(
        "--slices",
        action="store_true",
        help="print every slice's cache replays (bound, round robin, pinned, shared LRU "
        "pools of the engines' size) and exit; starts no engine",
    )
    parser.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default=ARRIVALS[0],
        help="closed (default): --concurrency clients, each sending its next request when its "
        "last is answered; trace: requests arrive at the trace's own times, compressed to --rate "
        "or --load, whatever is in flight (open loop, as users arrive)",
    )
    parser.add_argument(
        "--load",
        type=positive_float,
        default=DEFAULT_LOAD,
        help="with --arrival trace: the arrival rate as a fraction of what round robin answers "
        "in a closed loop of --concurrency clients, measured first in the same run",
    )
    parser.add_argument(
        "--rate",
        type=positive_float,
        default=None,
        help="with --arrival trace: requests per second instead of --load",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=4,
        help="clients of the closed loop (--arrival closed, and the --load calibration)",
    )
    parser.add_argument(
        "--gateways",
        type=positive_int,
        default=1,
        help="gateway replicas per policy, each request sent to the next one in turn (a load "
        "balancer that knows no conversations, as in front of replicated routers); each replica "
        "of kv_aware reads the same engine events, each approx_prefix only its own history",
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=4, help="tokens generated per request"
    )
    parser.add_argument(
        "--block-tokens",
        type=positive_int,
        default=32,
        help="token ids per trace block, and the engines' block size (a multiple of 32)",
    )
    parser.add_argument(
        "--engine-blocks", type=positive_int, default=384, help="KV blocks per engine"
    )
    parser.add_argument(
        "--max-model-len", type=positive_int, default=4096, help="the engines' context"
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated, run in this order; NAME[field=value] runs NAME with a "
        "CoordinatorConfig field changed (kv_aware[queue_weight=0.5]), to compare settings "
        "in one run",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="replays per policy, in alternating order (figures pool every round)",
    )
    parser.add_argument("--trace", default=None, help="a Mooncake trace (default: bundled)")
    parser.add_argument("--json", action="store_true", help="one JSON object per policy")
    parser.add_argument(
        "--connector",
        action="store_true",
        help="also kv_mesh and round_robin on engines with kvmesh's KV connector and stores",
    )
    parser.add_argument(
        "--store-blocks", type=positive_int, default=2048, help="blocks each kvmesh store holds"
    )
    parser.add_argument(
        "--pulls",
        choices=("direct", "async", "ask"),
        default="direct",
        help="with --connector, how an engine loads blocks only the other store holds: copied "
        "out of its arena in the step (default), pulled by its own store and loaded "
        "asynchronously, or pulled while the scheduler asks (Prepare), to compare",
    )
    parser.add_argument(
        "--decisions",
        default=None,
        metavar="DIR",
        help="write each policy's routing decisions, request by request with the engine's "
        "realized hit, to DIR/<policy>.jsonl and compare the policies on them",
    )


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of the slice: its conversation and its prompt's token ids."""

    conversation: int
    prompt: tuple[int, ...]
    at_s: float = 0.0
    """When the trace sends it, in seconds after the slice's first request."""


@dataclass(slots=True)
class PolicyResult:
    policy: str
    requests: int
    errors: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    requests_per_s: float
    engine_prefix_hit_rate: float
    bound_hit_ratio: float
    engine_hit_rates: dict[str, float] = field(default_factory=dict)
    engine_requests: dict[str, int] = field(default_factory=dict)
    connector: bool = False
    engine_external_hit_rate: float = 0.0
    computed_tokens_per_request: float = 0.0
    """Prompt tokens the engines computed (neither cached nor loaded), per request: the
    prefill work a policy left, which the machine's load does not change as it does TTFT."""
    engine_queue_ms: float = 0.0
    engine_prefill_ms: float = 0.0
    engine_ttft_ms: float = 0.0
    """Means per request from the engines' own histograms: waiting to be scheduled, computing
    the prompt, and their whole TTFT (the client's TTFT adds the gateway and HTTP)."""
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)
    """CPU per answered request, by `CPU_CLASSES` (the model's compute, and what is not)."""
    gateway_route_ms: float = 0.0
    gateway_first_byte_ms: float = 0.0
    """Means per request from the gateway's decision records: reading, hashing and routing the
    request, then from sending it to the engine to the engine's first bytes."""
    arrival: str = "closed"
    offered_requests_per_s: float = 0.0
    """With trace arrivals, the rate requests were sent at (answered: `requests_per_s`)."""
    gateways: int = 1
    """Gateway replicas the requests were spread over (``--gateways``)."""

    @property
    def label(self) -> str:
        return f"{self.policy}+mesh" if self.connector else self.policy


# ----------------------------------------------------------------------------- the slice


def to_turns(
    picked: list[tuple[int, TraceRequest]], block_tokens: int, vocab: int, full_blocks: bool = True
) -> list[Turn]:
    """Each request's prompt: its blocks' token ids, cut to `prompt_tokens` (a partial last
    block unless `full_blocks`)."""
    table = blocks_tokens({b for _, r in picked for b in r.hash_ids}, block_tokens, vocab)
    first = picked[0][1].timestamp_ms if picked else 0
    return [
        Turn(
            c,
            tuple(t for b in r.hash_ids for t in table[b])[
                : prompt_tokens(r, block_tokens, full_blocks)
            ],
            (r.timestamp_ms - first) / 1000,
        )
        for c, r in picked
    ]


# ----------------------------------------------------------------------------- engines


def block_bytes(model: Path, block_tokens: int) -> int:
    """KV bytes of one block of the model (keys and values, every layer)."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    width = 4 if "32" in str(dtype) else 2
    return 2 * cfg["num_hidden_layers"] * block_tokens * heads * head_dim * width


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples in an exposition text, over the label sets
    that have `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            if all(w in head for w in want):
                total += float(value)
    return total


def routing_view(text: str) -> str:
    """What the gateway's router saw in one run (from its /metrics), for the log."""
    matched = metric_sum(text, "kvmesh_gateway_matched_blocks_total")
    pulled = metric_sum(text, "kvmesh_gateway_pull_blocks_total")
    stored = metric_sum(text, "kvmesh_gateway_store_blocks_total")
    prompt = metric_sum(text, "kvmesh_gateway_prompt_blocks_total")
    gaps = {
        outcome: metric_sum(text, "kvmesh_engine_event_gaps_total", outcome=outcome)
        for outcome in ("healed", "uncovered")
    }
    held = metric_sum(text, "kvmesh_engine_event_batches_total", outcome="held")
    return (
        f"the router expected {matched:.0f} of {prompt:.0f} prompt blocks cached"
        + (f", {stored:.0f} loaded from the engine's store" if stored else "")
        + (f" and {pulled:.0f} pulled through the mesh" if pulled else "")
        + "; event gaps "
        f"healed {gaps['healed']:.0f}, uncovered {gaps['uncovered']:.0f}; batches held back {held:.0f}"
    )


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) process `pid` has used so far, from /proc (0 elsewhere):
    on a machine whose cores the engines share, what the gateway takes from them."""
    try:
        fields_ = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


CPU_CLASSES = ("model", "engine core", "API server", "gateway", "stores", "client")
"""Where the machine's CPU went during a replay: the engines' model runners (vLLM's
``VLLM::Worker`` processes, or the API server itself when it runs the model in process),
their engine cores (scheduling, ``VLLM::EngineCore``), their API servers (HTTP, the OpenAI
layer, detokenizing), the gateway, the kvmesh stores and this benchmark's own client."""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cpu_by_class(
    engines: list[VLLMEngine], gateways: Sequence[int], stores: Sequence[int] = ()
) -> dict[str, float]:
    """CPU seconds used so far per `CPU_CLASSES` entry (from /proc; zeros elsewhere)."""
    out = dict.fromkeys(CPU_CLASSES, 0.0)
    for e in engines:
        if e.process is None:
            continue
        for pid in process_tree(e.process.pid):
            comm = _comm(pid)
            kind = (
                "model" if "Worker" in comm else "engine core" if "EngineCor" in comm
                else "API server" if pid == e.process.pid else None
            )  # fmt: skip
            if kind is not None:
                out[kind] += process_cpu_s(pid)
    out["gateway"] = sum(process_cpu_s(pid) for pid in gateways)
    out["stores"] = sum(process_cpu_s(pid) for pid in stores)
    out["client"] = process_cpu_s(os.getpid())
    return out


async def cache_counters(
    client: httpx.AsyncClient, engine: VLLMEngine
) -> tuple[float, float, float]:
    """The engine's prefix-cache hits, queries and external (connector) hits, in tokens."""
    text = (await client.get(engine.url + "/metrics")).text
    return (
        metric_sum(text, "vllm:prefix_cache_hits_total"),
        metric_sum(text, "vllm:prefix_cache_queries_total"),
        metric_sum(text, "vllm:external_prefix_cache_hits_total"),
    )


ENGINE_TIMES = {
    "queue_s": "vllm:request_queue_time_seconds_sum",
    "prefill_s": "vllm:request_prefill_time_seconds_sum",
    "ttft_s": "vllm:time_to_first_token_seconds_sum",
    "requests": "vllm:time_to_first_token_seconds_count",
}
"""Where an engine's requests spent their time to the first token, summed (vLLM's histograms):
waiting to be scheduled, then computing the prompt; the rest of its TTFT is its API server."""


async def engine_times(client: httpx.AsyncClient, engine: VLLMEngine) -> dict[str, float]:
    text = (await client.get(engine.url + "/metrics")).text
    return {key: metric_sum(text, name) for key, name in ENGINE_TIMES.items()}


async def reset_cache(
    client: httpx.AsyncClient, engine: VLLMEngine, timeout_s: float = 30.0, every_s: float = 0.2
) -> None:
    """Empty the engine's prefix cache (``POST /reset_prefix_cache``), then make it publish so.

    vLLM answers ``{"success": false}`` while blocks are still in use (a
    request finishing, a transfer), so the call is repeated every `every_s`
    until it succeeds; past `timeout_s` `DeadlineExceeded` says what the
    engine kept answering. An engine without the route (404: started
    without ``VLLM_SERVER_DEV_MODE=1``) is a `ConfigError` at once.

    An idle engine queues its ``AllBlocksCleared`` event until its next
    step, and a gateway started meanwhile replays the engine's event history
    without it: its index would hold the previous policy's blocks until the
    engine next steps (its first routed request). One request of fewer
    tokens than a block (it stores no block, so publishes nothing else)
    makes the engine step and publish the clear before any gateway starts.
    """
    deadline = time.monotonic() + timeout_s
    answer = ""
    while True:
        resp = await client.post(engine.url + "/reset_prefix_cache")
        if resp.status_code == 404:
            raise ConfigError(
                f"engine {engine.name} has no POST /reset_prefix_cache (404): start it with "
                "VLLM_SERVER_DEV_MODE=1, which the benchmark needs to empty its cache between "
                "policies"
            )
        try:
            success = resp.status_code == 200 and resp.json().get("success") is True
        except ValueError:
            success = False
        if success:
            break
        answer = f"{resp.status_code} {resp.text[:200]!r}"
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(
                f"engine {engine.name} did not reset its prefix cache in {timeout_s:g} s: it "
                f"kept answering {answer} (vLLM says success false while blocks are in use: "
                "is a request still running on it?)"
            )
        await asyncio.sleep(every_s)
    body = {"model": engine.spec.served_model_name, "prompt": [3, 4], "max_tokens": 1}
    resp = await client.post(engine.url + "/v1/completions", json=body)
    if resp.status_code != 200:
        raise TransportError(
            f"engine {engine.name} reset its prefix cache but failed the request that makes it "
            f"publish so: {resp.status_code} {resp.text[:200]!r}"
        )


# ----------------------------------------------------------------------------- gateway


GATEWAY_SETTINGS = {
    "shared_prefix_blocks": "--shared-prefix-blocks",
    "placement": "--placement",
}
"""Routing settings of the gateway itself (not `CoordinatorConfig` fields), as its flags."""


@dataclass(frozen=True, slots=True)
class PolicySetting:
    """A ``--policies`` entry: the policy, and the gateway's environment and flags for it."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    flags: tuple[str, ...] = ()


def policy_setting(label: str) -> PolicySetting:
    """``NAME[field=value;...]`` -> the policy's name, the gateway's environment for its
    `CoordinatorConfig` fields (``KVMESH_<FIELD>``, as it reads them) and its flags for the
    gateway's own settings (`GATEWAY_SETTINGS`); a plain name has none."""
    name, bracket, rest = label.partition("[")
    if not bracket:
        return PolicySetting(label)
    if not rest.endswith("]"):
        raise ConfigError(
            f"--policies {label!r}: write NAME[field=value] (e.g. kv_aware[queue_weight=0.5])"
        )
    env: dict[str, str] = {}
    flags: list[str] = []
    for item in rest[:-1].split(";"):
        field_, eq, value = item.partition("=")
        key = field_.strip()
        if not eq or not key:
            raise ConfigError(f"--policies {label!r}: {item!r} is not field=value")
        if key in GATEWAY_SETTINGS:
            flags += [GATEWAY_SETTINGS[key], value.strip()]
        elif key in {f.name for f in fields(CoordinatorConfig)}:
            env[f"KVMESH_{key.upper()}"] = value.strip()
        else:
            raise ConfigError(
                f"--policies {label!r}: {key!r} is no CoordinatorConfig field "
                f"(queue_weight, overlap_weight, max_load_ratio, ...) nor a gateway setting "
                f"({', '.join(GATEWAY_SETTINGS)})"
            )
    return PolicySetting(name, env, tuple(flags))


def start_gateway(
    engines: list[VLLMEngine],
    label: str,
    block_tokens: int,
    engine_blocks: int,
    port: int,
    stores: dict[str, StoreProcess] | None = None,
) -> subprocess.Popen[bytes]:
    """`stores`: each engine's kvmesh store, whose page events the gateway follows."""
    setting = policy_setting(label)
    cmd = [
        sys.executable, "-m", "kvmesh.app.cli", "gateway",
        "--tokenizer", str(engine_model()),
        "--block-size", str(block_tokens),
        "--policy", setting.name,
        *setting.flags,
        "--history-blocks", str(engine_blocks),
        "--events-topic", engines[0].spec.topic,
        "--port", str(port),
        "--log-level", "warning",
    ]  # fmt: skip
    for e in engines:
        cmd += ["--engine", e.url, "--name", e.name]
        if e.events_endpoint and e.replay_endpoint:
            cmd += ["--events", e.events_endpoint, "--replay", e.replay_endpoint]
        store = (stores or {}).get(e.name)
        if store is not None and store.events and store.events_replay:
            cmd += ["--store-events", store.events, "--store-replay", store.events_replay]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, **setting.env})


async def wait_healthy(client: httpx.AsyncClient, url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TransportError(f"the gateway exited with {proc.returncode}")
        try:
            if (await client.get(url + "/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    raise TransportError("the gateway did not become healthy in 60 s")


async def wait_in_step(client: httpx.AsyncClient, url: str, timeout_s: float = 120.0) -> None:
    """Until the gateway's index follows every engine: a batch applied, none stale.

    A gateway started beside engines that ran before joins their event
    streams late and heals the gap from their replay buffers, routing
    without affinity meanwhile. The benchmark measures routing, not that
    catch-up, so each policy's replay starts once it is over (the hash
    canary at start-up makes every engine publish a batch).
    """
    deadline = time.monotonic() + timeout_s
    engines: dict[str, dict[str, object]] = {}
    while time.monotonic() < deadline:
        engines = (await client.get(url + "/health")).json()["engines"]
        if all(not e["stale"] and int(str(e["events_seq"])) >= 0 for e in engines.values()):
            return
        await asyncio.sleep(0.1)
    raise TransportError(
        f"the gateway's index did not catch up with the engines' events in {timeout_s:g} s: "
        f"{engines}"
    )


# ----------------------------------------------------------------------------- replay


@dataclass(slots=True)
class Replay:
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    by_engine: dict[str, int] = field(default_factory=dict)
    decision_of: dict[int, int] = field(default_factory=dict)
    """Turn index -> the gateway's decision id (``x-kvmesh-decision``), this round."""
    ttft_of: dict[int, float] = field(default_factory=dict)
    held: int = 0
    """Open loop: turns sent after their arrival time because the previous turn was unanswered."""

    def merge(self, other: Replay) -> None:
        """Add `other`'s figures (a later round); the per-turn maps are per round: not kept."""
        self.ttfts += other.ttfts
        self.errors += other.errors
        self.held += other.held
        self.first_error = self.first_error or other.first_error
        for engine, n in other.by_engine.items():
            self.by_engine[engine] = self.by_engine.get(engine, 0) + n

    def fail(self, why: str) -> None:
        self.errors += 1
        if not self.first_error:
            self.first_error = why
            print(f"request failed: {why}", file=sys.stderr, flush=True)


Gateways = str | Sequence[str]
"""Where a replay sends its requests: one URL, or gateway replicas' URLs taken in turn."""


def url_for(urls: Gateways, index: int) -> str:
    """Turn `index`'s gateway: request by request in turn over the replicas, as a load
    balancer in front of them does, whatever conversation the request continues."""
    return urls if isinstance(urls, str) else urls[index % len(urls)]


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    turn: tuple[int, Turn],
    max_tokens: int,
    out: Replay,
) -> None:
    index, prompt = turn[0], turn[1].prompt
    body = {
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},  # the gateway reads the realized hit
    }
    t0 = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out.fail(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
                return
            engine = resp.headers.get("x-kvmesh-engine", "?")
            decision = resp.headers.get(DECISION_HEADER)
            if decision is not None and decision.isdigit():
                out.decision_of[index] = int(decision)
            async for line in resp.aiter_lines():
                if ttft is None and line.startswith("data:"):
                    ttft = time.perf_counter() - t0
                if line.startswith('data: {"error"'):
                    out.fail(line[:300])
                    return
    except httpx.HTTPError as exc:
        out.fail(f"{type(exc).__name__}: {exc}")
        return
    if ttft is None:
        out.fail("the stream ended without a chunk")
        return
    out.ttfts.append(ttft)
    out.ttft_of[index] = ttft
    out.by_engine[engine] = out.by_engine.get(engine, 0) + 1


def previous_turns(turns: Sequence[Turn]) -> list[int | None]:
    """Each turn's conversation's previous turn (its index), which must be answered first: a
    user sends a follow-up after reading the answer."""
    last: dict[int, int] = {}
    out: list[int | None] = []
    for i, turn in enumerate(turns):
        out.append(last.get(turn.conversation))
        last[turn.conversation] = i
    return out


def send_times(turns: Sequence[Turn], rate: float) -> list[float]:
    """Each turn's arrival, in seconds after the replay starts: the trace's own gaps (its bursts
    and lulls) compressed so that the slice arrives at `rate` requests per second on average."""
    if rate <= 0:
        raise ConfigError(f"an arrival rate must be positive, not {rate}")
    if not turns:
        return []
    start = turns[0].at_s
    span = turns[-1].at_s - start
    if span <= 0:  # the trace sends them at once: evenly spaced instead
        return [i / rate for i in range(len(turns))]
    factor = (len(turns) - 1) / rate / span
    return [(t.at_s - start) * factor for t in turns]


async def replay(
    url: Gateways, turns: list[Turn], concurrency: int, max_tokens: int, out: Replay
) -> float:
    """Closed loop: `concurrency` clients take the turns in trace order; a turn waits for its
    predecessor.

    Returns the wall time; TTFTs and errors go to `out`.
    """
    previous = previous_turns(turns)
    done = [asyncio.Event() for _ in turns]
    todo = deque(range(len(turns)))
    async with _client(concurrency * 2) as client:

        async def client_loop() -> None:
            while todo:
                i = todo.popleft()
                before = previous[i]
                if before is not None:
                    await done[before].wait()
                try:
                    await one_request(client, url_for(url, i), (i, turns[i]), max_tokens, out)
                finally:
                    done[i].set()

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return time.perf_counter() - t0


async def replay_open(
    url: Gateways, turns: list[Turn], rate: float, max_tokens: int, out: Replay
) -> float:
    """Open loop, as a service's users arrive: each turn is sent at its `send_times` arrival
    whatever is still in flight, or when its conversation's previous turn is answered if that
    is later (counted in `out.held`).

    Returns the wall time; TTFTs and errors go to `out`.
    """
    at = send_times(turns, rate)
    previous = previous_turns(turns)
    done = [asyncio.Event() for _ in turns]
    async with _client(None) as client:
        t0 = time.perf_counter()

        async def send(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + at[i] - time.perf_counter()))
            before = previous[i]
            if before is not None and not done[before].is_set():
                out.held += 1
                await done[before].wait()
            try:
                await one_request(client, url_for(url, i), (i, turns[i]), max_tokens, out)
            finally:
                done[i].set()

        await asyncio.gather(*(send(i) for i in range(len(turns))))
        return time.perf_counter() - t0


def _client(connections: int | None) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(600.0, connect=5.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=None),
    )


@dataclass(slots=True)
class Measured:
    """One policy's replays so far (rounds add up)."""

    replay: Replay = field(default_factory=Replay)
    wall_s: float = 0.0
    hits: dict[str, float] = field(default_factory=dict)
    queries: dict[str, float] = field(default_factory=dict)
    external: dict[str, float] = field(default_factory=dict)
    spent: dict[str, float] = field(default_factory=dict)
    """`ENGINE_TIMES` over the engines and rounds."""
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds per `CPU_CLASSES` entry over the rounds' replays."""
    rounds: int = 0
    decisions: list[dict[str, object]] = field(default_factory=list)
    """Per request and round: the gateway's decision record with the turn's index and TTFT."""


async def measure(
    policy: str,
    engines: list[VLLMEngine],
    turns: list[Turn],
    args: argparse.Namespace,
    into: Measured,
    stores: dict[str, StoreProcess] | None = None,
) -> None:
    """One replay of the slice under `policy`, after resetting the engines' prefix caches,
    through ``--gateways`` gateway replicas of it."""
    async with httpx.AsyncClient(timeout=30) as client:
        for e in engines:
            await reset_cache(client, e)
        ports = [free_port() for _ in range(getattr(args, "gateways", 1))]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        procs = [
            start_gateway(engines, policy, args.block_tokens, args.engine_blocks, port, stores)
            for port in ports
        ]
        try:
            for url, proc in zip(urls, procs, strict=True):
                await wait_healthy(client, url, proc)
            reads_events = policy_setting(policy).name != HISTORY_POLICY
            if reads_events and all(e.events_endpoint for e in engines):
                for url in urls:
                    await wait_in_step(client, url)  # the history router reads no events
            before = [await cache_counters(client, e) for e in engines]
            times_before = [await engine_times(client, e) for e in engines]
            pids = [proc.pid for proc in procs]
            store_pids = [st.process.pid for st in (stores or {}).values() if st.process]
            classes_before = cpu_by_class(engines, pids, store_pids)
            this = Replay()
            if args.rate is None:
                wall = await replay(urls, turns, args.concurrency, args.max_tokens, this)
            else:
                wall = await replay_open(urls, turns, args.rate, args.max_tokens, this)
            into.replay.merge(this)
            classes_after = cpu_by_class(engines, pids, store_pids)
            cpu = classes_after["gateway"] - classes_before["gateway"]
            for key in CPU_CLASSES:
                into.cpu[key] = into.cpu.get(key, 0.0) + classes_after[key] - classes_before[key]
            after = [await cache_counters(client, e) for e in engines]
            times_after = [await engine_times(client, e) for e in engines]
            for was, now in zip(times_before, times_after, strict=True):
                for key in ENGINE_TIMES:
                    into.spent[key] = into.spent.get(key, 0.0) + now[key] - was[key]
            views = [(await client.get(url + "/metrics")).text for url in urls]
            records = [
                (await client.get(url + "/kvmesh/decisions")).json()["decisions"] for url in urls
            ]
            into.decisions += joined(records, this, turns, into.rounds)
            whose = "gateway's" if len(urls) == 1 else f"{len(urls)} gateways'"
            print(
                f"  {policy}: {'; '.join(routing_view(v) for v in views)}; the {whose} CPU "
                f"during the replay {cpu:.1f} s of {wall:.1f} s, "
                f"{len(this.ttfts) / wall:.2f} requests/s"
                + (f", {this.held} follow-ups held for their answer" if this.held else ""),
                file=sys.stderr,
                flush=True,
            )
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
    into.wall_s += wall
    into.rounds += 1
    for e, a, b in zip(engines, after, before, strict=True):
        into.hits[e.name] = into.hits.get(e.name, 0.0) + a[0] - b[0]
        into.queries[e.name] = into.queries.get(e.name, 0.0) + a[1] - b[1]
        into.external[e.name] = into.external.get(e.name, 0.0) + a[2] - b[2]


def joined(
    records: Sequence[list[dict[str, object]]], replay_: Replay, turns: list[Turn], round_: int
) -> list[dict[str, object]]:
    """The gateways' decision records of one replay (one list per gateway replica, turn `i`
    sent to replica ``i % len(records)``), each with its turn (index, conversation, TTFT in
    ms, round, gateway); records of requests retried on another engine are left out."""
    by_id = [{int(str(r["id"])): r for r in per_gateway} for per_gateway in records]
    out: list[dict[str, object]] = []
    for index, rid in sorted(replay_.decision_of.items()):
        gateway = index % len(by_id)
        record = by_id[gateway].get(rid)
        if record is None:
            continue
        ttft = replay_.ttft_of.get(index)
        out.append(
            {
                **record,
                "turn": index,
                "conversation": turns[index].conversation,
                "round": round_,
                "gateway": gateway,
                "ttft_ms": None if ttft is None else round(ttft * 1000, 2),
            }
        )
    return out


def _mean_of(records: list[dict[str, object]], key: str) -> float:
    values = [float(v) for r in records if isinstance(v := r.get(key), int | float)]
    return sum(values) / len(values) if values else 0.0


def summarize(policy: str, m: Measured, bound: float, connector: bool = False) -> PolicyResult:
    ms = [t * 1000 for t in m.replay.ttfts]
    n = len(ms)
    hits, queries = sum(m.hits.values()), sum(m.queries.values())
    external = sum(m.external.values())
    done = m.spent.get("requests", 0.0) or 1.0
    return PolicyResult(
        policy,
        n,
        m.replay.errors,
        sum(ms) / n if n else 0.0,
        percentile(ms, 50),
        percentile(ms, 99),
        n / m.wall_s if m.wall_s > 0 else 0.0,
        hits / queries if queries else 0.0,
        bound,
        {e: (m.hits[e] / q if q else 0.0) for e, q in m.queries.items()},
        dict(sorted(m.replay.by_engine.items())),
        connector,
        external / queries if queries else 0.0,
        (queries - hits - external) / n if n else 0.0,
        engine_queue_ms=m.spent.get("queue_s", 0.0) * 1000 / done,
        engine_prefill_ms=m.spent.get("prefill_s", 0.0) * 1000 / done,
        engine_ttft_ms=m.spent.get("ttft_s", 0.0) * 1000 / done,
        cpu_ms_per_request={k: round(v * 1000 / n, 2) for k, v in m.cpu.items()} if n else {},
        gateway_route_ms=_mean_of(m.decisions, "route_ms"),
        gateway_first_byte_ms=_mean_of(m.decisions, "first_byte_ms"),
    )


def print_table(results: list[PolicyResult], args: argparse.Namespace, slice_info: str) -> None:
    print(slice_info)
    gateways = getattr(args, "gateways", 1)
    if gateways > 1:
        print(
            f"{gateways} gateway replicas per policy, requests sent to each in turn "
            "(kv_aware's read the same engine events; approx_prefix's each its own history)"
        )
    served = getattr(args, "served", None)  # set when --load calibrated the rate
    if args.rate is None:
        print(f"closed loop: {args.concurrency} clients, each waiting for its answer")
    else:
        print(
            f"open loop: the trace's arrivals at {args.rate:.2f} requests/s"
            + (f" ({args.load:g} x round robin's closed-loop {served:.2f})" if served else "")
        )
    print(
        f"{'policy':<16} {'TTFT mean':>10} {'p50':>8} {'p99':>8} {'req/s':>7} "
        f"{'engine hit':>10} {'external':>8} {'bound':>6}  per engine (requests, hit rate)"
    )
    for r in results:
        per = ", ".join(
            f"{e}: {r.engine_requests.get(e, 0)} @ {h:.2f}" for e, h in r.engine_hit_rates.items()
        )
        print(
            f"{r.label:<16} {r.ttft_mean_ms:>8.1f}ms {r.ttft_p50_ms:>6.1f}ms "
            f"{r.ttft_p99_ms:>6.1f}ms {r.requests_per_s:>7.2f} {r.engine_prefix_hit_rate:>10.3f} "
            f"{r.engine_external_hit_rate:>8.3f} {r.bound_hit_ratio:>6.3f}  {per}"
            + (f"  ERRORS {r.errors}" if r.errors else "")
        )
    print(
        "where the TTFT goes, ms per request: in the engine, waiting to be scheduled + "
        "computing the prompt + the rest of its TTFT (its API server, the step running when the "
        "request came) = the engine's TTFT; the gateway's routing and its wait for the engine's "
        "first bytes; the client's TTFT"
    )
    for r in results:
        rest = r.engine_ttft_ms - r.engine_queue_ms - r.engine_prefill_ms
        print(
            f"{r.label:<16} {r.engine_queue_ms:6.1f} + {r.engine_prefill_ms:6.1f} + {rest:6.1f} "
            f"= {r.engine_ttft_ms:6.1f}; gateway {r.gateway_route_ms:5.1f} + "
            f"{r.gateway_first_byte_ms:6.1f}; client {r.ttft_mean_ms:6.1f}"
        )
    if any(r.cpu_ms_per_request for r in results):
        print("CPU per request, ms: " + ", ".join(CPU_CLASSES))
        for r in results:
            cpu = r.cpu_ms_per_request
            print(
                f"{r.label:<16} "
                + " ".join(f"{cpu.get(k, 0.0):7.1f}" for k in CPU_CLASSES)
                + f"  (all but the model: {sum(cpu.values()) - cpu.get('model', 0.0):.1f})"
            )
    rr = next((r for r in results if r.policy == "round_robin" and not r.connector), None)
    for r in results:
        if r.connector and r.bound_hit_ratio > 0:
            reuse = r.engine_prefix_hit_rate + r.engine_external_hit_rate
            line = f"{r.label}: reuse (local + external) / bound = {reuse / r.bound_hit_ratio:.2f}"
            if rr is not None and r.ttft_mean_ms > 0:
                ratio = rr.ttft_mean_ms / r.ttft_mean_ms
                line += f", mean TTFT round_robin / {r.label} = {ratio:.2f}x"
            print(line)
    by = {r.policy: r for r in results if not r.connector}
    for name, kv in by.items():  # kv_aware and its variants (kv_aware[field=value])
        if policy_setting(name).name != "kv_aware" or kv.ttft_mean_ms <= 0:
            continue
        for other in ("round_robin", "approx_prefix"):
            if other in by:
                ratio = by[other].ttft_mean_ms / kv.ttft_mean_ms
                line = f"mean TTFT {other} / {name} = {ratio:.2f}x"
                if kv.computed_tokens_per_request > 0:
                    work = by[other].computed_tokens_per_request / kv.computed_tokens_per_request
                    line += f" (prompt tokens computed per request: {work:.2f}x)"
                print(line)


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError("--policies names no policy")
    for label in policies:
        policy_setting(label)  # a malformed setting is refused before the engines start
    for name in (
        "requests", "min_turns", "concurrency", "max_tokens", "engine_blocks", "rounds", "gateways"
    ):  # fmt: skip
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    if args.arrival == "closed" and args.rate is not None:
        raise ConfigError("--rate sets trace arrivals: leave it out with --arrival closed")
    max_blocks = (args.max_model_len - args.max_tokens) // args.block_tokens
    reqs = load_trace(args.trace)
    if args.slices:
        print(
            slices_table(
                reqs, args.requests, args.min_turns, max_blocks, args.block_tokens,
                args.engine_blocks,
            )
        )  # fmt: skip
        return 0
    spec = EngineSpec(
        block_size=args.block_tokens,
        kv_cache_memory_bytes=args.engine_blocks * block_bytes(engine_model(), args.block_tokens),
        max_model_len=args.max_model_len,
        extra_args=("--enable-prompt-tokens-details",),  # each answer's cached tokens
    )
    picked = trace_slice(reqs, args.requests, args.min_turns, max_blocks, args.slice)
    replays = cache_replays(
        slice_prompts(picked, args.block_tokens, args.full_blocks),
        args.block_tokens,
        args.engine_blocks,
    )
    bound = replays.bound
    vocab = PromptTokenizer(engine_model()).vocab_size  # ids the engines' tokenizer knows
    turns = to_turns(picked, args.block_tokens, vocab, args.full_blocks)
    blocks = [len(t.prompt) / args.block_tokens for t in turns]
    slice_info = (
        f"slice {args.slice} ({'full' if args.full_blocks else 'partial'} last blocks): "
        f"{len(turns)} requests of {len({t.conversation for t in turns})} conversations "
        f"(>= {args.min_turns} turns) in trace order, {sum(blocks) / len(blocks):.1f} blocks of "
        f"{args.block_tokens} tokens per prompt; hit rates of LRU replays: bound {bound:.3f}, "
        f"round robin {replays.round_robin:.3f}, conversations pinned {replays.pinned:.3f}, "
        f"one shared pool {replays.shared:.3f}; "
        f"{args.rounds} round(s); engines: {args.engine_blocks} blocks, one core each"
    )
    print(slice_info, file=sys.stderr, flush=True)
    cores = os.cpu_count() or 1
    engines = [
        VLLMEngine(replace(spec, cpu_bind=str(i % cores)), name=f"engine-{i}") for i in range(2)
    ]
    try:
        for e in engines:
            e.start()
        asyncio.run(warm_up(engines, args))
        if args.arrival == "trace" and args.rate is None:
            args.rate = calibrated_rate(engines, turns, args)
        measured = {p: Measured() for p in policies}
        for round_ in range(args.rounds):
            for policy in policies if round_ % 2 == 0 else policies[::-1]:
                print(f"round {round_ + 1}: {policy} ...", file=sys.stderr, flush=True)
                asyncio.run(measure(policy, engines, turns, args, measured[policy]))
        results = [summarize(p, measured[p], bound) for p in policies]
        keep_decisions(args, {p: m.decisions for p, m in measured.items()})
    finally:
        for e in engines:
            e.stop()
    if args.connector:
        results += run_connector(spec, turns, bound, args)
    results = [
        replace(
            r, arrival=args.arrival, offered_requests_per_s=args.rate or 0.0, gateways=args.gateways
        )
        for r in results
    ]
    if args.json:
        for r in results:
            print(json.dumps(asdict(r)))
    else:
        print_table(results, args, slice_info)
    return 0


def calibrated_rate(
    engines: list[VLLMEngine], turns: list[Turn], args: argparse.Namespace
) -> float:
    """`--load` times the requests per second round robin answers on these engines, this slice,
    in a closed loop of `--concurrency` clients: a rate that means the same on a faster machine."""
    closed = argparse.Namespace(**{**vars(args), "rate": None})
    m = Measured()
    print("calibrating: round_robin in a closed loop ...", file=sys.stderr, flush=True)
    asyncio.run(measure("round_robin", engines, turns, closed, m))
    if m.replay.errors or m.wall_s <= 0:
        raise TransportError(f"the calibration replay failed: {m.replay.first_error}")
    served = len(m.replay.ttfts) / m.wall_s
    rate = args.load * served
    args.served = served
    print(
        f"trace arrivals at {rate:.2f} requests/s: {args.load:g} x round robin's {served:.2f} "
        f"in a closed loop of {args.concurrency} clients",
        file=sys.stderr,
        flush=True,
    )
    return rate


def keep_decisions(args: argparse.Namespace, by_policy: dict[str, list[dict[str, object]]]) -> None:
    """With ``--decisions DIR``: each policy's records to DIR/<policy>.jsonl, and why their
    engine hits differ (`engine_decisions.report`) to stderr."""
    if args.decisions is None:
        return
    folder = Path(args.decisions)
    for policy, records in by_policy.items():
        engine_decisions.write(folder / f"{policy}.jsonl", records)
    print(engine_decisions.report(by_policy), file=sys.stderr, flush=True)


async def warm_up(engines: list[VLLMEngine], args: argparse.Namespace) -> None:
    """One request per engine, so that the first measured request pays no start-up cost."""
    async with httpx.AsyncClient(timeout=300) as client:
        for e in engines:
            body = {
                "model": e.spec.served_model_name,
                "prompt": list(range(3, 3 + 4 * args.block_tokens)),
                "max_tokens": args.max_tokens,
            }
            resp = await client.post(e.url + "/v1/completions", json=body)
            if resp.status_code != 200:
                raise TransportError(f"engine {e.name} warm-up failed: {resp.text[:200]}")


def run_connector(
    spec: EngineSpec, turns: list[Turn], bound: float, args: argparse.Namespace
) -> list[PolicyResult]:
    """`CONNECTOR_POLICIES` on two engines with kvmesh's connector, a store beside each
    (each store the other's peer), the stores emptied before every policy."""
    nbytes = engine_block_nbytes(engine_model(), args.block_tokens)
    stores = [
        StoreProcess(
            block_nbytes=nbytes, block_size=args.block_tokens, pages=args.store_blocks,
            hash_algo=spec.hash_algo, seed=spec.seed, name=f"store-{i}",
            events=local_endpoint(f"store-{i}-events"),  # its page events, for the gateway
            events_replay=local_endpoint(f"store-{i}-replay"),
        )
        for i in range(2)
    ]  # fmt: skip
    cores = os.cpu_count() or 1
    engines: list[VLLMEngine] = []
    try:
        for store in stores:
            store.start()
        for i, store in enumerate(stores):
            other = stores[1 - i]
            config = connector_config(
                store.page_address,
                store.control_address,
                peers=[other.page_address],
                peer_controls=[other.control_address],  # what the peer holds, read by the engine
                direct_pulls=getattr(args, "pulls", "direct") == "direct",
                async_pulls=getattr(args, "pulls", "direct") != "ask",
            )
            engine_spec = replace(
                spec,
                cpu_bind=str(i % cores),
                extra_args=(*spec.extra_args, "--kv-transfer-config", config),
            )
            engines.append(VLLMEngine(engine_spec, name=f"engine-{i}"))
        for e in engines:
            e.start()
        asyncio.run(warm_up(engines, args))
        measured = {p: Measured() for p in CONNECTOR_POLICIES}
        for round_ in range(args.rounds):
            order = CONNECTOR_POLICIES if round_ % 2 == 0 else CONNECTOR_POLICIES[::-1]
            for policy in order:
                print(f"round {round_ + 1}: {policy} with the connector ...", file=sys.stderr)
                for store in stores:
                    store.restart()  # empty: each policy starts from cold stores
                by_engine = {e.name: s for e, s in zip(engines, stores, strict=True)}
                asyncio.run(measure(policy, engines, turns, args, measured[policy], by_engine))
        keep_decisions(args, {f"{p}+mesh": m.decisions for p, m in measured.items()})
        return [summarize(p, measured[p], bound, connector=True) for p in CONNECTOR_POLICIES]
    finally:
        for e in engines:
            e.stop()
        for store in stores:
            store.stop()
