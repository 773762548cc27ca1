"""kvmesh's metrics: one definition per metric, exported the way the process is run.

Every metric is declared here once (`Metric`: kind, name, help, label names),
so names never fork between backends: ``kvmesh_`` prefix, ``_total`` on
counters, ``_seconds`` / ``_bytes`` for units. A recording goes to

- this process's prometheus-client registry, always: a process outside Ray
  (``kvmesh start``, the gateway) serves it on ``/metrics``
  (`serve_metrics`), and `Metric.value` reads it back, which is how
  ``WorkerStats`` and ``CoordinatorStats`` are filled (one source, no
  counters mirrored by hand);
- Ray's metrics API (``ray.util.metrics``) too when the process is a Ray
  actor, as Ray Serve does: Ray's metrics agent exports it on the node's
  Prometheus endpoint (``ray.init(_metrics_export_port=...)``, ``ray start
  --metrics-export-port``), where Ray prefixes every name with ``ray_``
  (``ray_kvmesh_routes_total``).

Labels: ``worker`` (a kvmesh worker's id), ``engine`` (a real engine's index
id), ``coordinator`` (the coordinator or shard actor's name), ``tenant``
(`kvmesh.worker.tenant_share.tenant_of`, never the cache salt itself: a
salt is a secret). Recording is a dictionary lookup and an add; nothing
here runs per page.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client import Counter as _PromCounter
from prometheus_client import Gauge as _PromGauge
from prometheus_client import Histogram as _PromHistogram

MetricKind = Literal["counter", "gauge", "histogram"]

ALL_METRICS: dict[str, Metric] = {}
"""Every metric of the process's registry, by name: kvmesh's own, which the docs table
and the dashboard list (a metric made in a registry of its own, as tests do, is not one)."""

RAY_PREFIX = "ray_"
"""What Ray's exporter puts before every application metric's name."""

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROUTE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1)
LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_ray_actor: bool = False  # set once this process is seen to be a Ray actor


def in_ray_actor() -> bool:
    """True in a Ray actor's process (where Ray's metrics API exports), False elsewhere.

    A process that never imported Ray is not an actor; the answer is kept
    once true (a process does not stop being an actor).
    """
    global _ray_actor
    if _ray_actor:
        return True
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    _ray_actor = ray.get_runtime_context().get_actor_id() is not None
    return _ray_actor


@dataclass(frozen=True, slots=True)
class MetricDef:
    """A metric's definition: what both backends are built from."""

    kind: MetricKind
    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def sample_name(self) -> str:
        """The exposition name of its main sample (``_total`` / ``_count`` added)."""
        return self.name + {"counter": "_total", "gauge": "", "histogram": "_count"}[self.kind]


class Metric:
    """One metric, recorded into prometheus-client and, in a Ray actor, Ray's metrics API.

    Use it like a prometheus-client metric: ``ROUTES.labels(coordinator, policy,
    worker).inc()``; `labels` takes the values positionally or by name and
    refuses missing or unknown ones (`ValueError`, as prometheus-client does).
    """

    def __init__(
        self,
        kind: MetricKind,
        name: str,
        help: str,
        labels: Iterable[str] = (),
        *,
        buckets: Iterable[float] = (),
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.definition = MetricDef(kind, name, help, tuple(labels), tuple(buckets))
        d = self.definition
        self._local: Any
        if kind == "counter":
            self._local = _PromCounter(name, help, d.labels, registry=registry)
        elif kind == "gauge":
            self._local = _PromGauge(name, help, d.labels, registry=registry)
        else:
            self._local = _PromHistogram(name, help, d.labels, buckets=d.buckets, registry=registry)
        self._ray: Any = None
        self._ray_lock = threading.Lock()
        self._children: dict[tuple[object, ...], MetricChild] = {}
        if registry is REGISTRY:
            ALL_METRICS[name] = self

    @property
    def name(self) -> str:
        return self.definition.name

    def labels(self, *values: str, **named: str) -> MetricChild:
        """The child for one set of label values (kept: a second call is a dict lookup)."""
        key = values if not named else (*sorted(named.items()),)
        child = self._children.get(key)
        if child is not None:
            return child
        names = self.definition.labels
        if values and named:
            raise ValueError(f"{self.name}: pass label values by position or by name, not both")
        if named:
            if set(named) != set(names):
                raise ValueError(f"{self.name}: labels are {names}, got {sorted(named)}")
            values = tuple(str(named[n]) for n in names)
        elif len(values) != len(names):
            raise ValueError(f"{self.name}: labels are {names}, got {len(values)} values")
        tags = dict(zip(names, (str(v) for v in values), strict=True))
        child = self._children[key] = MetricChild(self, self._local.labels(*tags.values()), tags)
        return child

    def value(self, **labels: str) -> float:
        """This process's value summed over the series that match `labels` (a subset of
        the metric's labels): a counter's total, a gauge's value, a histogram's count."""
        return self._sum(self.definition.sample_name, labels)

    def histogram_sum(self, **labels: str) -> float:
        """A histogram's sum of observations over the series that match `labels`."""
        return self._sum(self.name + "_sum", labels)

    def values_by(self, label: str, **labels: str) -> dict[str, float]:
        """This process's value per value of `label`, over the series that match `labels`."""
        _settle_names()
        out: dict[str, float] = {}
        for sample in self._samples(self.definition.sample_name, labels):
            key = sample.labels[label]
            out[key] = out.get(key, 0.0) + sample.value
        return out

    def forget(self, **labels: str) -> None:
        """Drop this process's series that match `labels` (their holder is gone)."""
        names = self.definition.labels
        self._children.clear()  # a kept child of a dropped series would count into nothing
        for sample in list(self._samples(self.definition.sample_name, labels)):
            if all(n in sample.labels for n in names):
                self._local.remove(*(sample.labels[n] for n in names))

    def _sum(self, sample_name: str, labels: Mapping[str, str]) -> float:
        _settle_names()
        return sum(s.value for s in self._samples(sample_name, labels))

    def _samples(self, sample_name: str, labels: Mapping[str, str]) -> Iterable[Any]:
        for family in self._local.collect():
            for sample in family.samples:
                if sample.name == sample_name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    yield sample

    def _ray_metric(self) -> Any:
        """Ray's object for this metric, built on first use in a Ray actor; else None."""
        if self._ray is not None or not in_ray_actor():
            return self._ray
        with self._ray_lock:
            if self._ray is None:
                from ray.util import metrics as ray_metrics

                d = self.definition
                if d.kind == "counter":
                    self._ray = ray_metrics.Counter(d.name, d.help, tag_keys=d.labels)
                elif d.kind == "gauge":
                    self._ray = ray_metrics.Gauge(d.name, d.help, tag_keys=d.labels)
                else:
                    self._ray = ray_metrics.Histogram(
                        d.name, d.help, boundaries=list(d.buckets), tag_keys=d.labels
                    )
        return self._ray


class MetricChild:
    """One labelled series of a `Metric`; records into every backend of the process."""

    __slots__ = ("_local", "_metric", "_tags")

    def __init__(self, metric: Metric, local: Any, tags: dict[str, str]) -> None:
        self._metric = metric
        self._local = local
        self._tags = tags

    def inc(self, amount: float = 1.0) -> None:
        self._local.inc(amount)
        ray_metric = self._metric._ray_metric()
        if ray_metric is not None:
            if self._metric.definition.kind == "counter":
                if amount:  # Ray refuses an increment of 0 (prometheus-client takes it)
                    ray_metric.inc(amount, tags=self._tags)
            else:
                ray_metric.set(self._local._value.get(), tags=self._tags)

    def dec(self, amount: float = 1.0) -> None:
        """Gauges only."""
        self._local.dec(amount)
        ray_metric = self._metric._ray_metric()
        if ray_metric is not None:
            ray_metric.set(self._local._value.get(), tags=self._tags)

    def set(self, value: float) -> None:
        """Gauges only."""
        self._local.set(value)
        ray_metric = self._metric._ray_metric()
        if ray_metric is not None:
            ray_metric.set(value, tags=self._tags)

    def observe(self, value: float) -> None:
        """Histograms only."""
        self._local.observe(value)
        ray_metric = self._metric._ray_metric()
        if ray_metric is not None:
            ray_metric.observe(value, tags=self._tags)

    def set_function(self, fn: Callable[[], float]) -> None:
        """A gauge read at scrape time; prometheus-client only (Ray has no callback gauge),
        so it is for processes outside Ray, such as the gateway."""
        self._local.set_function(fn)


class Counter(Metric):
    def __init__(self, name: str, help: str, labels: Iterable[str] = (), **kw: Any) -> None:
        super().__init__("counter", name, help, labels, **kw)


class Gauge(Metric):
    def __init__(self, name: str, help: str, labels: Iterable[str] = (), **kw: Any) -> None:
        super().__init__("gauge", name, help, labels, **kw)


class Histogram(Metric):
    def __init__(
        self,
        name: str,
        help: str,
        labels: Iterable[str] = (),
        buckets: Iterable[float] = LATENCY_BUCKETS,
        **kw: Any,
    ) -> None:
        super().__init__("histogram", name, help, labels, buckets=buckets, **kw)


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Serve this process's metrics on ``http://host:port/metrics`` from a daemon thread
    (prometheus-client's server); returns the port bound (`port` 0: a free one)."""
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)


def metrics_table() -> str:
    """Every metric as a Markdown table (docs/operations.md holds it; a test keeps it in
    step): the name a scrape shows (``_total`` on counters; ``ray_`` before it when an
    actor exports it), its kind, labels and help."""
    rows = [
        "| metric | kind | labels | what it counts |",
        "| --- | --- | --- | --- |",
    ]
    for name in sorted(ALL_METRICS):
        d = ALL_METRICS[name].definition
        shown = name + ("_total" if d.kind == "counter" else "")
        labels = ", ".join(f"`{label}`" for label in d.labels) or "-"
        text = " ".join(d.help.split()).replace("|", "\\|")
        rows.append(f"| `{shown}` | {d.kind} | {labels} | {text} |")
    return "\n".join(rows) + "\n"


def ray_metrics_endpoints() -> list[str]:
    """Where this Ray cluster's metrics are served: every live node's Prometheus endpoint
    (``http://IP:PORT/metrics``, the port ``ray.init(_metrics_export_port=...)`` or ``ray
    start --metrics-export-port`` set, or one Ray chose). Needs ``ray.init()`` first."""
    import ray

    return [
        f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for node in ray.nodes()
        if node.get("Alive") and node.get("MetricsExportPort")
    ]


class InstanceNames:
    """Label values for objects that count under a name of their own, unique while alive.

    A coordinator labels its series with its actor name; two live in one
    process (index shards, tests) would add into each other's series, so the
    second gets ``name#2``. A name is free again once its holder is gone, and
    its series go with it, so a later holder starts from zero.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._gone: deque[str] = deque()  # appended by finalizers: atomic, takes no lock
        _INSTANCE_NAMES.append(self)

    def claim(self, owner: object, name: str) -> str:
        self.settle()
        with self._lock:
            label, n = name, 1
            while label in self._live:
                n += 1
                label = f"{name}#{n}"
            self._live.add(label)
        weakref.finalize(owner, self._gone.append, label)
        return label

    def settle(self) -> None:
        """Free the names of holders gone since the last call and drop their series.

        A holder's finalizer only queues its name: finalizers run wherever the
        garbage collector does, possibly inside prometheus-client's lock of the
        very metric they would clean (a test run deadlocked so). The cleaning
        waits for ordinary code: `claim` and every read of a metric's value.
        """
        while self._gone:
            label = self._gone.popleft()
            with self._lock:
                self._live.discard(label)
            for metric in list(ALL_METRICS.values()):
                if self.label in metric.definition.labels:
                    metric.forget(**{self.label: label})


_INSTANCE_NAMES: list[InstanceNames] = []


def _settle_names() -> None:
    for names in _INSTANCE_NAMES:
        names.settle()


COORDINATOR_NAMES = InstanceNames("coordinator")


# ---------------------------------------------------------------- workers (label `worker`)

WORKER_REQUESTS = Counter(
    "kvmesh_worker_requests",
    "Requests a worker answered",
    ["worker"],
)
WORKER_ERRORS = Counter(
    "kvmesh_worker_errors",
    "Requests a worker failed, by kind (the KVMeshError subclass: InvalidInput, PoolExhausted, "
    "...); cancelled requests count in kvmesh_requests_cancelled_total instead",
    ["worker", "kind"],
)
PROMPT_PAGES = Counter(
    "kvmesh_prompt_pages",
    "Full prompt pages of the requests a worker answered, by where each came from: local (a "
    "hit in its own pool), pulled (from a peer), computed",
    ["worker", "source"],
)
REQUEST_HASH_MISMATCHES = Counter(
    "kvmesh_request_hash_mismatches",
    "Requests whose router-computed page hashes failed the worker's check (it hashed the "
    "prompt itself): router and worker disagree on the hash seed, algorithm or keys",
    ["worker"],
)
PAGES_PUSHED = Counter(
    "kvmesh_pages_pushed",
    "Pages a prefill worker pushed to decode workers (disaggregation)",
    ["worker"],
)
POOL_PAGES = Gauge(
    "kvmesh_pool_pages",
    "A worker's pages per tier, by state: used (held by requests or cached), free, cached "
    "(hittable now); updated every heartbeat",
    ["worker", "tier", "state"],
)
TRANSFER_BYTES = Counter(
    "kvmesh_transfer_bytes",
    "Page bytes a worker received (pull) or sent (push) from or to a peer, by transport",
    ["worker", "direction", "transport"],
)
TRANSFER_SECONDS = Histogram(
    "kvmesh_transfer_seconds",
    "Time of one pull or push with a peer, by the transport that delivered it",
    ["worker", "direction", "transport"],
    buckets=LATENCY_BUCKETS,
)
TRANSFER_REFUSED = Counter(
    "kvmesh_transfer_refused",
    "Transfer work a worker refused or cut short, by reason (no grant, hash proof, "
    "pin cap, stream deadline, idle stream, push eviction cap, ...)",
    ["worker", "reason"],
)
FETCH_PINNED_PAGES = Gauge(
    "kvmesh_fetch_pinned_pages",
    "Page references FetchPages streams hold on a worker's pool now (capped by "
    "TransferConfig.fetch_pin_fraction of the pool)",
    ["worker"],
)
REQUESTS_CANCELLED = Counter(
    "kvmesh_requests_cancelled",
    "Requests a worker stopped before answering, by reason: the caller cancelled it "
    "(ray.cancel), its deadline passed, or the caller's process went away",
    ["worker", "reason"],
)
PEER_TRANSFERS = Counter(
    "kvmesh_peer_transfers",
    "Pulls and pushes a worker made with a peer, by the transport that carried them (a "
    "torch.distributed transfer that fell back counts under grpc)",
    ["worker", "direction", "transport"],
)
DIST_FALLBACKS = Counter(
    "kvmesh_dist_fallbacks",
    "torch.distributed transfers of a worker that failed and were redone over gRPC",
    ["worker", "direction"],
)
DIST_LINKS = Counter(
    "kvmesh_dist_links",
    "torch.distributed links a worker opened to a peer (client end) or served for one "
    "(server end)",
    ["worker", "end"],
)

# ------------------------------------------------ the coordinator (label `coordinator`)

ROUTES = Counter(
    "kvmesh_routes",
    "Route decisions, by policy and the worker chosen",
    ["coordinator", "policy", "worker"],
)
ROUTE_SECONDS = Histogram(
    "kvmesh_route_seconds",
    "Time of one route decision (index walk and policy), by policy",
    ["coordinator", "policy"],
    buckets=ROUTE_BUCKETS,
)
DEGRADED_ROUTES = Counter(
    "kvmesh_degraded_routes",
    "Route decisions made without a fresh view (every candidate stale or draining)",
    ["coordinator"],
)
PREDICTED_PAGES = Counter(
    "kvmesh_predicted_pages",
    "Prompt pages route decisions promised, by kind: local (a hit on the chosen worker) or "
    "pull (from the peer named)",
    ["coordinator", "kind"],
)
REALIZED_PAGES = Counter(
    "kvmesh_realized_pages",
    "Prompt pages workers really hit (local) or pulled (pull), as reported back",
    ["coordinator", "kind"],
)
ROUTE_RESULTS = Counter(
    "kvmesh_route_results",
    "Route results reported back, by outcome: kept (realized as promised) or mismatch (a "
    "hashing or tokenization disagreement between router and worker shows here)",
    ["coordinator", "outcome"],
)
EVENT_BATCHES = Counter(
    "kvmesh_event_batches",
    "Worker KV event batches, by worker and what the index did with them (applied, "
    "replaced, ignored, stale: a gap; rejected: undecodable)",
    ["coordinator", "worker", "outcome"],
)
EVENT_GAPS = Counter(
    "kvmesh_event_gaps",
    "Gaps in a worker's event sequence (the worker is stale until a snapshot)",
    ["coordinator", "worker"],
)
EVENT_LAG = Histogram(
    "kvmesh_event_lag_seconds",
    "From a worker stamping an event batch to the coordinator applying it (wall clocks of two "
    "processes: a skew shows here)",
    ["coordinator", "worker"],
    buckets=LAG_BUCKETS,
)
WORKERS = Gauge(
    "kvmesh_workers",
    "Workers registered with a coordinator, by state: all, stale (an event gap not yet "
    "healed), draining",
    ["coordinator", "state"],
)
INDEXED_PAGES = Gauge(
    "kvmesh_indexed_pages",
    "Distinct pages in a coordinator's index",
    ["coordinator"],
)
WORKERS_EXPIRED = Counter(
    "kvmesh_workers_expired",
    "Workers a coordinator dropped for missing heartbeats",
    ["coordinator"],
)
LINKS_OPENED = Counter(
    "kvmesh_coordinator_links",
    "torch.distributed links a coordinator handed out rendezvous for",
    ["coordinator"],
)
COORDINATOR_ERRORS = Counter(
    "kvmesh_coordinator_errors",
    "Calls a coordinator refused, by kind (the KVMeshError subclass)",
    ["coordinator", "kind"],
)
COORDINATOR_CALLS = Counter(
    "kvmesh_coordinator_calls",
    "Calls a coordinator actor served, by method (the request path makes a route and a report)",
    ["coordinator", "method"],
)
REPORT_WAITS = Counter(
    "kvmesh_route_report_waits",
    "Routes that waited for the reports they follow (RouteQuery.after), by outcome: waited "
    "(the reports came), timed_out (a heartbeat interval passed; routed without them)",
    ["coordinator", "outcome"],
)

# ---------------------------------------------------------------- the gateway
# (kvmesh.gateway) (kvmesh.gateway) in front of real engines; `engine` is the engine's name

GATEWAY_REQUESTS = Counter(
    "kvmesh_gateway_requests",
    "HTTP requests the gateway answered, by endpoint and status code",
    ["endpoint", "status"],
)
GATEWAY_ROUTED = Counter(
    "kvmesh_gateway_routed",
    "Requests sent to an engine, by engine and routing policy",
    ["engine", "policy"],
)
GATEWAY_PROMPT_BLOCKS = Counter(
    "kvmesh_gateway_prompt_blocks",
    "Full prompt blocks of the requests routed to an engine",
    ["engine"],
)
GATEWAY_MATCHED_BLOCKS = Counter(
    "kvmesh_gateway_matched_blocks",
    "Prompt blocks the router expected the chosen engine to hold (its index or history)",
    ["engine"],
)
GATEWAY_PULL_BLOCKS = Counter(
    "kvmesh_gateway_pull_blocks",
    "Prompt blocks the router (kv_mesh) expected the chosen engine to pull through the mesh "
    "from the engine holding more of the prefix",
    ["engine"],
)
GATEWAY_REUSED_BLOCKS = Counter(
    "kvmesh_gateway_reused_blocks",
    "Prompt blocks the engine reported it did not compute (its own cache and the connector's "
    "loads: usage.prompt_tokens_details.cached_tokens), for answers that carry it",
    ["engine"],
)
CONNECTOR_BLOCKS = Counter(
    "kvmesh_connector_blocks",
    "Blocks kvmesh's KV connector moved for its vLLM engine (`store`: the engine's store), by "
    "outcome: loaded; refused (its seal failed: recomputed); undelivered (claimed, but the "
    "store failed or no longer held it: recomputed); saved; dropped (the store was behind); "
    "save_failed",
    ["store", "outcome"],
)
CONNECTOR_HOOK_SECONDS = Histogram(
    "kvmesh_connector_hook_seconds",
    "Wall time of kvmesh's KV connector in each vLLM hook, waits included (`hook`: "
    "get_num_new_matched_tokens with its Prepare wait, build_connector_meta, start_load_kv "
    "with its copies and seal checks, wait_for_save with its stage; send: the saver thread's "
    "save, off the "
    "step; prepare: a store's Prepare on the connector's thread pool, which a request waits "
    "for), in the engine's scheduler or worker process",
    ["store", "hook"],
    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
CONNECTOR_HOOK_CPU_SECONDS = Counter(
    "kvmesh_connector_hook_cpu_seconds",
    "CPU time the calling thread spent in each of kvmesh's KV connector hooks (`hook` as in "
    "kvmesh_connector_hook_seconds; waits for the store, a lock or a core not counted): what "
    "the connector itself takes from the engine's pinned core",
    ["store", "hook"],
)
CONNECTOR_PREPARE_ANSWERS = Counter(
    "kvmesh_connector_prepare_answers",
    "How kvmesh's KV connector answered vLLM's get_num_new_matched_tokens, by answer: "
    "direct (nothing to ask: the engine's own hit covers the prompt), read (from the stores' "
    "shared-memory directories, no call), peers (read from them, some of the blocks in peer "
    "stores' arenas: copied from there in the step), async (read from them, peers holding some "
    "of the "
    "blocks: loaded asynchronously after the store pulls them), in_time (the store's Prepare "
    "answered within "
    "prepare_wait_ms), pending (None: vLLM skips the request this step and asks again), late "
    "(answered on a later ask), timed_out, failed",
    ["store", "answer"],
)
CONNECTOR_SHM_UNMAPPED = Counter(
    "kvmesh_connector_shm_unmapped",
    "Times kvmesh's KV connector moved blocks over gRPC because it could not use its store's "
    "shared-memory arena, by reason: not_offered (the store runs without one), unmappable "
    "(it offers one this host cannot map: another host or container, a stale file)",
    ["store", "reason"],
)
ENGINE_STORE_BLOCKS = Counter(
    "kvmesh_engine_store_blocks",
    "Blocks the kvmesh store beside an engine took, by outcome: saved (new from its engine), "
    "pulled (from a peer store), forgotten (its engine refused them on load)",
    ["store", "outcome"],
)
STORE_EVENT_BATCHES = Counter(
    "kvmesh_store_event_batches",
    "Event batches a store beside an engine published as vLLM KV events "
    "(`kvmesh.worker.store_events`), by outcome: published, replayed (sent again to a "
    "subscriber that missed them), unsent (its queue was full: a gap healed from replay)",
    ["store", "outcome"],
)
GATEWAY_STORE_BLOCKS = Counter(
    "kvmesh_gateway_store_blocks",
    "Prompt blocks the router (kv_mesh) expected the chosen engine to load from its own "
    "kvmesh store (held there, gone from the engine's cache)",
    ["engine"],
)
GATEWAY_RETRIES = Counter(
    "kvmesh_gateway_engine_retries",
    "Requests moved to another engine because this one could not be reached or broke off "
    "before answering, by reason",
    ["engine", "reason"],
)
GATEWAY_ENGINE_DOWN = Counter(
    "kvmesh_gateway_engine_down",
    "Times an engine was marked down (failed /health or a failed request)",
    ["engine"],
)
GATEWAY_ENGINE_UP = Gauge(
    "kvmesh_gateway_engine_up",
    "1 while the gateway routes to the engine, 0 while it is down (read at scrape time)",
    ["engine"],
)
GATEWAY_INFLIGHT = Gauge(
    "kvmesh_gateway_inflight_requests",
    "Requests the gateway has in flight on an engine (read at scrape time)",
    ["engine"],
)
GATEWAY_INFLIGHT_PREFILL = Gauge(
    "kvmesh_gateway_inflight_prefill_tokens",
    "Prompt tokens the gateway expects an engine still to prefill (read at scrape time)",
    ["engine"],
)
GATEWAY_FIRST_BYTE = Histogram(
    "kvmesh_gateway_first_byte_seconds",
    "From sending a request to an engine to its first response bytes",
    ["engine"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)

# Real engines' KV events (kvmesh/engine_subscriber.py); `engine` is the
# index worker id (``engine-0``, ``engine-0@dp1`` for a data-parallel rank).
ENGINE_EVENT_BATCHES = Counter(
    "kvmesh_engine_event_batches",
    "Engine KV event batches received, by what the index did with them "
    "(applied, replaced, ignored, held, quarantined)",
    ["engine", "outcome"],
)
ENGINE_BAD_PAYLOADS = Counter(
    "kvmesh_engine_bad_payloads",
    "Engine KV event messages dropped as malformed, by reason (frame, seq, topic, decode, "
    "dp_rank); each one drops the engine's index entries, which a lost batch may have changed",
    ["engine", "reason"],
)
ENGINE_EVENT_GAPS = Counter(
    "kvmesh_engine_event_gaps",
    "Gaps in an engine's event sequence, by outcome: healed from its replay socket, or "
    "uncovered (its index entries dropped, then followed afresh)",
    ["engine", "outcome"],
)
ENGINE_RESTARTS = Counter(
    "kvmesh_engine_restarts",
    "Engine restarts seen in its event sequence (seq back to 0): each starts a new incarnation",
    ["engine"],
)
ENGINE_CANARY = Counter(
    "kvmesh_engine_canary",
    "Hash-parity canary runs by outcome (passed, mismatch, timeout)",
    ["engine", "outcome"],
)
REPLICA_FAILOVERS = Counter(
    "kvmesh_router_failovers",
    "A router replica's calls that went to another replica, by reason: hedged (its own "
    "shard was slow or failed), shard_failed (a replica's shard failed a route), "
    "replica_down (a replica was skipped for state changes)",
    ["reason"],
)

# -- a worker's tiers (kvmesh.worker.tiered_cache): tier is gpu (device), cpu (host) or disk;
# tenant is kvmesh.worker.tenant_share.tenant_of(cache_salt), never the salt itself

TIER_PAGES = Gauge(
    "kvmesh_tier_pages",
    "Cached pages a tenant holds in one tier of a worker now",
    ["worker", "tier", "tenant"],
)
TIER_EVICTIONS = Counter(
    "kvmesh_tier_evictions",
    "Pages a tier dropped for room (to the tier below, or gone from the bottom tier), "
    "by the tenant that lost them",
    ["worker", "tier", "tenant"],
)
TIER_SPILLS = Counter(
    "kvmesh_tier_spills",
    "Pages that moved down into a tier (device -> cpu, cpu -> disk)",
    ["worker", "tier"],
)
TIER_PROMOTIONS = Counter(
    "kvmesh_tier_promotions",
    "Pages a hit brought back from a lower tier into the device pool, by the tier they "
    "came from",
    ["worker", "tier"],
)
DISK_PAGES_DROPPED = Counter(
    "kvmesh_disk_pages_dropped",
    "Disk-tier page files deleted unserved, by reason (corrupt, truncated, format: another "
    "model's page, stray: a temp file of an interrupted write)",
    ["worker", "reason"],
)

# -- the cluster's pages per tenant, as the coordinator counts them from the workers' events
# (kvmesh.coordinator.tenant_shares); tenant is kvmesh.tenants.tenant_of(cache_salt)

TENANT_CLUSTER_PAGES = Gauge(
    "kvmesh_tenant_cluster_pages",
    "Pages a tenant holds across the cluster in one tier (gpu, cpu, disk, other), "
    "counted from the workers' KV events",
    ["tier", "tenant"],
)
TENANT_SHARE_PAGES = Gauge(
    "kvmesh_tenant_share_pages",
    "A tenant's fair share of the pages the cluster caches now (all tiers), by weight "
    "among the tenants holding pages",
    ["tenant"],
)


def counter_value(name: str, **labels: str) -> int:
    """The value of counter `name` (without ``_total``) for exactly `labels` in this
    process; 0 before its first increment."""
    return int(REGISTRY.get_sample_value(f"{name}_total", labels) or 0)
