"""Configuration in one place: a dataclass per component, read the same way everywhere.

Defaults fit a laptop (CPU, a few hundred pages). A value is set in layers,
a later layer winning: the defaults, then the environment (``KVMESH_<FIELD>``,
upper case, or the variable a field names in its ``env`` metadata, e.g.
``KVMESH_MODEL_SEED``), then explicit values (CLI flags, keyword arguments).
`build_cluster_config` merges layers into a `ClusterConfig`;
`kvmesh.settings.load_cluster_config` is what every entry point calls (it
adds the checks that need a component's registry). `cluster_settings` lists
every field with its variable, type and default.

Each section checks its own values in ``__post_init__`` (types from the
annotations, ranges, fields that must agree) and raises `InvalidSetting`
naming the field; a loader re-raises it naming where the value came from
(``KVMESH_MAX_MESSAGE_BYTES='-1' ...``). Components own their section; add
fields there, with their range in the section's check.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvmesh.environment import refuse_unknown_variables
from kvmesh.errors import ConfigError, InvalidSetting

T = TypeVar("T")

DEFAULT_SEED = "kvmesh-default-seed"

MAX_SEED = 2**63 - 1
"""Largest model / router seed (torch and `random` take it; it travels as int64)."""

DEVICE_MEDIA: tuple[str, ...] = ("gpu", "cuda", "device")
"""Media a device pool's events may name: the coordinator index's device tier."""

_ACCEPTS: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "bool": ((bool,), "true or false"),
    "str": ((str,), "a string"),
    "str | None": ((str, type(None)), "a string or unset"),
}
"""The annotations a config field may have: the values each accepts, and how to say so."""


def _refuse(section: Any, name: str, reason: str) -> InvalidSetting:
    qualified = f"{type(section).__name__}.{name}"
    return InvalidSetting(f"{qualified}={getattr(section, name)!r}", reason, (qualified,))


def _check_section(
    section: Any,
    *,
    positive: tuple[str, ...] = (),
    non_negative: tuple[str, ...] = (),
    not_empty: tuple[str, ...] = (),
    fractions: tuple[str, ...] = (),
) -> None:
    """Every field's type (from its annotation; a section: its class) and finiteness, then
    the signs and ranges of the fields named. Raises `InvalidSetting` for the first bad one."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        factory: Any = f.default_factory
        accepted: tuple[type, ...]
        if factory is not dataclasses.MISSING:  # a nested section
            accepted, kind = (factory,), f"a {factory.__name__}"
        else:
            accepted, kind = _ACCEPTS[str(f.type)]
        # bool is an int to isinstance: neither may stand for the other
        if isinstance(value, bool) != (bool in accepted) or not isinstance(value, accepted):
            raise _refuse(section, f.name, f"must be {kind}")
        if isinstance(value, float) and not math.isfinite(value):
            raise _refuse(section, f.name, "must be a finite number")
    for name in positive:
        if getattr(section, name) <= 0:
            raise _refuse(section, name, "must be positive")
    for name in non_negative:
        if getattr(section, name) < 0:
            raise _refuse(section, name, "must be >= 0")
    for name in not_empty:
        if not getattr(section, name):
            raise _refuse(section, name, "must not be empty")
    for name in fractions:
        if not 0 <= getattr(section, name) <= 1:
            raise _refuse(section, name, "must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class HashConfig:
    """Page identity: page size, cluster seed and hash function."""

    page_size: int = 16  # tokens per page; only full pages are hashed and cached
    seed: str = DEFAULT_SEED  # the cluster's page-hash seed: a secret, same on every node
    algo: str = "sha256"  # page hash: "sha256" or "xxh3_128" (kvmesh.hashing)

    def __post_init__(self) -> None:
        # algo: a name in kvmesh.hashing.HASH_FUNCTIONS (kvmesh.settings checks it)
        _check_section(self, positive=("page_size",), not_empty=("seed", "algo"))


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Local page pool and cache manager."""

    num_pages: int = 512  # pages in each worker's pool (page 0 is the null page)
    enable_caching: bool = True  # keep computed full pages for reuse (off: compute every time)
    # the tier the device pool's events name: the index's device tier whatever the torch
    # device (gpu, cuda or device); "cpu" is the host tier, whose hits cost a copy
    medium: str = "gpu"
    event_token_ids: bool = True  # PagesStored carries the pages' token ids
    use_eagle: bool = False  # drop the last matched page (EAGLE recomputes its hidden states)
    # tiers below the device pool (kvmesh.worker.tiered_cache; docs/tiers.md); with any tier
    # the device pool's events name "gpu", the host tier's "cpu", the disk tier's "disk"
    host_pages: int = 0  # host-memory pages the device pool's evictions spill to (0: none)
    disk_dir: str = ""  # folder of the disk tier's page files ("": no disk tier)
    disk_bytes: int = 0  # the disk tier's byte budget (needed with disk_dir)
    disk_fsync: bool = True  # fsync each page file and the folder (crash-safe; slower)
    disk_adopt: bool = True  # on start, re-adopt the page files disk_dir holds (else delete)
    # "lru", or "fair": evict from tenants above their share first (CoordinatorConfig's
    # tenant_weights weigh them)
    eviction: str = "lru"

    def __post_init__(self) -> None:
        _check_section(self, not_empty=("medium",), non_negative=("host_pages", "disk_bytes"))
        if self.medium.lower() not in DEVICE_MEDIA:
            raise _refuse(
                self,
                "medium",
                f"must name the device tier ({', '.join(DEVICE_MEDIA)}): the index reads "
                "another medium as a lower tier and charges every local hit a promotion",
            )
        if self.num_pages < 2:
            raise _refuse(self, "num_pages", "must be at least 2 (page 0 is the null page)")
        if self.disk_dir and not self.disk_bytes:
            raise _refuse(self, "disk_bytes", "must be > 0 when disk_dir is set")
        if self.eviction not in ("lru", "fair"):
            raise _refuse(self, "eviction", "must be 'lru' or 'fair'")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The small deterministic transformer every worker runs (shapes the KV tensors)."""

    vocab_size: int = 256  # token ids are in [0, vocab_size) (256: the byte tokenizer)
    num_layers: int = 4  # transformer layers (each has its own K and V per page)
    num_heads: int = 4  # attention (query) heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention); divides num_heads
    head_dim: int = 16  # size of one head (even: rotary embeddings rotate pairs)
    ffn_dim: int = 128  # hidden size of the feed-forward block
    max_positions: int = 8192  # longest prompt plus answer, in tokens
    seed: int = field(default=1234, metadata={"env": "KVMESH_MODEL_SEED"})  # model weights
    dtype: str = "float32"  # model and KV page dtype (a name in kvmesh.worker.model.DTYPES)
    device: str = "auto"  # model and KV pages: "auto" (cuda if the worker has one), "cpu", "cuda:N"
    rope_theta: float = 10000.0  # rotary embedding base
    norm_eps: float = 1e-5  # RMS norm epsilon
    prefill_chunk_tokens: int = 512  # chunked prefill: tokens per model call (rounded to pages)

    def __post_init__(self) -> None:
        # dtype: a name in kvmesh.worker.model.DTYPES; device: "cpu", "cuda" or "cuda:N"
        # (kvmesh.settings checks both against the worker's registries)
        _check_section(
            self,
            positive=(
                "vocab_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "ffn_dim",
                "max_positions",
                "rope_theta",
                "norm_eps",
                "prefill_chunk_tokens",
            ),
            non_negative=("seed",),
        )
        if self.seed > MAX_SEED:
            raise _refuse(self, "seed", f"must be at most {MAX_SEED}")
        if self.num_heads % self.num_kv_heads:
            raise _refuse(
                self, "num_heads", f"must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise _refuse(self, "head_dim", "must be even (rotary embeddings rotate pairs)")


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Worker gRPC server and the transfer paths between workers."""

    def __post_init__(self) -> None:
        # transport: a name in kvmesh.worker.peers.TRANSPORTS; the grpc_* tuning sizes
        # and max_message_bytes vs the chunk headers: kvmesh.settings asks the transfer server
        _check_section(
            self,
            positive=(
                "max_message_bytes",
                "chunk_bytes",
                "deadline_s",
                "keepalive_ms",
                "keepalive_timeout_ms",
                "fetch_streams",
                "dist_timeout_s",
                "dist_batch_bytes",
                "dist_depth",
                "dist_connect_timeout_s",
                "dist_idle_timeout_s",
                "fetch_stream_timeout_s",
                "fetch_idle_timeout_s",
                "fetch_window_pages",
                "fetch_peer_pin_fraction",
                "fetch_pin_fraction",
                "push_grant_ttl_s",
                "push_evict_window_s",
            ),
            non_negative=(
                "retries",
                "retry_backoff_s",
                "fetch_pin_wait_s",
            ),
            not_empty=("transport",),
            fractions=("fetch_peer_pin_fraction", "push_evict_fraction"),
        )
        if not 0 <= self.port <= 65535:
            raise _refuse(self, "port", "must be a TCP port in 0..65535 (0: pick a free one)")
        if self.fetch_pin_fraction >= 1:
            raise _refuse(
                self, "fetch_pin_fraction", "must be below 1: the rest of the pool is for requests"
            )

    host: str = "127.0.0.1"  # where workers' gRPC page servers bind (0.0.0.0: multi-node)
    port: int = 0  # 0: pick a free port
    max_message_bytes: int = 64 * 1024 * 1024  # largest gRPC message either way
    chunk_bytes: int = 512 * 1024  # page bytes per FetchPages message (bench: least CPU per GiB)
    deadline_s: float = 10.0  # deadline of every page-transfer call
    keepalive_ms: int = 10_000  # gRPC keepalive ping interval
    transport: str = "grpc"  # or "dist"
    tls_cert: str | None = None  # PEM certificate of the workers' gRPC servers (TLS on)
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_ca: str | None = None  # set: mutual TLS (clients must present a cert from this CA)
    auth_token: str | None = None  # bearer token every transfer call carries (16+ chars)
    tls_root_ca: str | None = None  # CA clients verify servers with; default tls_ca, then system
    tls_server_name: str | None = None  # name in the peers' certificates if not their host
    keepalive_timeout_ms: int = 5_000  # a keepalive ping unanswered this long drops the link
    fetch_streams: int = 2  # concurrent FetchPages streams (own connections) per pull
    retries: int = 3  # extra attempts on UNAVAILABLE, idempotent calls only
    retry_backoff_s: float = 0.05  # first backoff; doubles, jittered, within the deadline
    dist_timeout_s: float = 30.0  # torch.distributed: rendezvous and every send/recv wait
    dist_batch_bytes: int = 64 * 1024 * 1024  # torch.distributed: largest batch per send
    dist_depth: int = 4  # torch.distributed: batches in flight (pages >= 1 MiB)
    dist_connect_timeout_s: float = 10.0  # torch.distributed: opening a link to a peer
    dist_idle_timeout_s: float = 3600.0  # torch.distributed: a link unused this long is closed
    # gRPC HTTP/2 and TCP tuning, set on servers and clients alike (0: gRPC's own default);
    # what each one measured: the kvmesh.worker.transfer_server module doc
    grpc_frame_bytes: int = 0  # grpc.http2.max_frame_size, 16 KiB .. 16 MiB - 1
    grpc_window_bytes: int = 0  # grpc.http2.lookahead_bytes: initial stream receive window
    grpc_bdp_probe: bool = True  # grpc.http2.bdp_probe: grow windows from the measured BDP
    grpc_write_buffer_bytes: int = 0  # grpc.http2.write_buffer_size
    grpc_read_chunk_bytes: int = 0  # grpc.experimental.tcp_read_chunk_size
    grpc_min_read_chunk_bytes: int = 0  # grpc.experimental.tcp_min_read_chunk_size
    grpc_max_read_chunk_bytes: int = 0  # grpc.experimental.tcp_max_read_chunk_size
    grpc_socket_buffer_bytes: int = 0  # grpc.tcp_receive_buffer_size (SO_RCVBUF)
    grpc_malloc_tune: bool = False  # glibc: keep freed transfer buffers mapped (process-wide)
    # pushes (prefill -> decode) are taken only against a grant of the receiving worker,
    # valid this long; and one peer's pushes may evict at most this fraction of the pool's
    # pages per window (a token bucket), so pushes cannot flush everyone else's cache
    push_grant_ttl_s: float = 60.0
    push_evict_fraction: float = 0.5  # share of the pool one peer's pushes may evict per window
    push_evict_window_s: float = 10.0  # the window of push_evict_fraction
    # FetchPages on the serving side: what one stream, one peer and all streams may hold
    # (docs/reliability.md, "A client that stops reading")
    fetch_stream_timeout_s: float = 60.0  # a stream's server-side deadline
    fetch_idle_timeout_s: float = 5.0  # one write that waits this long for the client to read
    fetch_window_pages: int = 4  # pages one stream pins at a time (pinned as it goes)
    fetch_peer_pin_fraction: float = 0.25  # share of the pool one peer's streams may pin
    fetch_pin_fraction: float = 0.5  # share of the pool all streams may pin (rest: requests)
    fetch_pin_wait_s: float = 1.0  # a stream over a cap waits this long for room, then refused


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """Coordinator actor, global index and routing."""

    namespace: str = "kvmesh"  # Ray namespace of the cluster's actors (one kvmesh per namespace)
    actor_name: str = "kvmesh-coordinator"  # name of the coordinator actor
    policy: str = "kv_aware"  # routing policy (a name in kvmesh.coordinator.policies)
    overlap_weight: float = 1.0  # kv_aware: weight of the pages left to prefill vs load
    temperature: float = 0.0  # kv_aware: softmax sampling over costs (0: always the cheapest)
    heartbeat_interval_s: float = 1.0  # how often workers report they are alive
    heartbeat_timeout_s: float = 5.0  # a worker silent this long is not routed to
    max_restarts: int = -1  # Ray restarts of the coordinator actor (-1: no limit)
    # kv_aware: cost = overlap_weight * (pages to prefill + queue_weight * queued prefill pages)
    #                  + decode_weight * active decode pages
    # Dynamo weighs decode pages 1.0; decode steps do not delay a prefill in the time
    # model (full workers are avoided anyway), and on the bundled trace 1.0 cut the page hit
    # ratio from 0.32 to 0.25. Raise it when decode shares the accelerator with prefill.
    decode_weight: float = 0.0
    queue_weight: float = 1.0  # kv_aware: weight of the prefill pages already queued
    # kv_aware's conversation placement: what a block of an engine's queued prefill weighs,
    # against a block it stored lately or would compute, when a new conversation is placed
    # (1: all alike, the rule before; 4 split bursts: mean TTFT 1.39x lower than 1 in the same
    # open-loop run, docs/engines.md)
    placement_queue_weight: float = 4.0
    pull_cost: float = 0.16  # pulling a page / computing it (6.4 ms vs ~41 ms per 512 tokens)
    # kv_aware by tier (coordinator/tiers.py), as fractions of recomputing a page (capped at 1),
    # from `kvmesh bench tiers` on the tiny model (docs/tiers.md: 0.68 / 6.11 vs 20.1 ms a page)
    host_hit_cost: float = 0.034  # kv_aware cost of a hit in host memory (promotion / recompute)
    disk_hit_cost: float = 0.30  # kv_aware cost of a hit on disk (read + promotion / recompute)
    # fair share of the cluster's pages per tenant: "tenant=weight,..." (kvmesh.tenants); a
    # tenant not named weighs 1
    tenant_weights: str = ""
    # kv_aware: per page a tenant above its share would take from other tenants on a worker
    # (0: off; bench capacity's quiet tenant gained nothing from 0.5: 0.927 vs 0.940 x alone)
    tenant_share_weight: float = 0.0
    max_load_ratio: float = 0.0  # kv_aware bounded load: skip workers above ratio * mean (0: off)
    consistent_hash_pages: int = 4  # leading pages that form the affinity key
    consistent_hash_vnodes: int = 64  # consistent_hash: ring points per worker
    consistent_hash_load_factor: float = 1.25  # bounded-load ring: cap = factor * mean load
    cache_threshold: float = 0.3  # cache_aware: min match rate for prefix affinity
    balance_abs_threshold: int = 64  # cache_aware: imbalance in active requests (absolute)
    balance_rel_threshold: float = 1.5  # cache_aware: and relative (max > rel * min)
    reorder_window: int = 64  # batches held back per worker while waiting for a gap to fill
    default_tier: str = "gpu"  # tier of events whose medium is None
    detached: bool = False  # actor lifetime="detached" (outlives the driver)
    # torch.distributed links (TransferConfig.transport="dist"): the coordinator hosts their
    # rendezvous store and advertises it at this address ("": the node's IP, for multi-node)
    rendezvous_host: str = "127.0.0.1"
    link_accept_timeout_s: float = 10.0  # how long the serving worker may take to accept a link
    # routing RNG (ties, random, softmax sampling)
    seed: int = field(default=0, metadata={"env": "KVMESH_ROUTER_SEED"})
    # at scale (docs/scale.md): the index split across this many shard actors (by worker), and
    # this many router replicas, each with its own copy of every shard fed the same events
    index_shards: int = 1  # 1: one coordinator actor holds the whole index
    router_replicas: int = 1  # router replicas, each with every shard's copy
    # a node label: replica r's router and shards run on nodes labelled <label>=r ("": anywhere)
    replica_node_label: str = ""
    # the gRPC routing API (proto's Coordinator service) for routers outside Ray: -1 off,
    # 0 a free port; TLS, mutual TLS and the bearer token are TransferConfig's
    api_host: str = "127.0.0.1"
    api_port: int = -1  # the routing API's port: -1 off, 0 a free one
    api_deadline_s: float = 5.0  # the longest any routing API call may take on the server

    def __post_init__(self) -> None:
        # policy: a name in kvmesh.coordinator.policies.REGISTRY, default_tier one of
        # kvmesh.coordinator.index.TIER_NAMES (kvmesh.settings checks both)
        _check_section(
            self,
            positive=(
                "heartbeat_interval_s",
                "heartbeat_timeout_s",
                "consistent_hash_pages",
                "consistent_hash_vnodes",
                "reorder_window",
                "link_accept_timeout_s",
                "index_shards",
                "router_replicas",
                "api_deadline_s",
            ),
            non_negative=(
                "overlap_weight",
                "temperature",
                "decode_weight",
                "queue_weight",
                "placement_queue_weight",
                "max_load_ratio",
                "host_hit_cost",
                "disk_hit_cost",
                "tenant_share_weight",
                "balance_abs_threshold",
                "balance_rel_threshold",
                "seed",
            ),
            not_empty=("namespace", "actor_name", "policy"),
            fractions=("pull_cost", "cache_threshold"),
        )
        if self.max_restarts < -1:
            raise _refuse(self, "max_restarts", "must be >= 0, or -1 for no limit")
        if self.consistent_hash_load_factor < 1:
            raise _refuse(self, "consistent_hash_load_factor", "must be >= 1")
        if not -1 <= self.api_port <= 65535:
            raise _refuse(self, "api_port", "must be a TCP port in 0..65535, or -1 for no API")
        if self.seed > MAX_SEED:
            raise _refuse(self, "seed", f"must be at most {MAX_SEED}")


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """Deployment profile and tenant binding; `kvmesh.security` checks and applies them."""

    profile: str = "dev"  # "production": Ray token auth, gRPC TLS (mTLS) and a bearer token
    allow_remote: bool = False  # dev: bind beyond loopback (e.g. 0.0.0.0) only when set
    require_mtls: bool = True  # production: peers must present a certificate from tls_ca
    api_keys_file: str | None = None  # JSON/YAML {api_key: cache_salt}: salts bound to keys

    def __post_init__(self) -> None:
        # profile: a name in kvmesh.security.PROFILES (kvmesh.settings checks it)
        _check_section(self, not_empty=("profile",))


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """What `kvmesh.app.connect()` starts: the whole embedded cluster."""

    num_workers: int = 4  # worker actors an embedded cluster starts
    prefill_workers: int = 0  # disaggregation: prefill workers (with decode_workers)
    decode_workers: int = 0  # disaggregation: decode workers (with prefill_workers)
    hash: HashConfig = field(default_factory=HashConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    # how long joining a running cluster (status, generate, replay, KVMesh.attach) waits
    # for its Ray GCS port to answer before one "no Ray cluster answers" error, seconds
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        _check_section(
            self,
            positive=("connect_timeout_s",),
            non_negative=("num_workers", "prefill_workers", "decode_workers"),
        )


# ------------------------------------------------------------------ reading settings

ENV_PREFIX = "KVMESH_"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True, slots=True)
class SettingInfo:
    """One field a user can set: where it sits, the variable that sets it, its type, default."""

    path: str  # "transfer.max_message_bytes"; a field of ClusterConfig itself: "num_workers"
    owner: type[Any]  # the section class the field belongs to
    name: str
    env: str  # the environment variable: KVMESH_MAX_MESSAGE_BYTES
    type: str  # the annotation, one of _ACCEPTS
    default: Any

    @property
    def qualified(self) -> str:
        """The name errors use: ``TransferConfig.max_message_bytes``."""
        return f"{self.owner.__name__}.{self.name}"


@dataclass(frozen=True, slots=True)
class Setting:
    """A value for one field and the name it was given by, shown in every error about it."""

    value: Any
    source: str  # "KVMESH_POLICY", "--policy", "CoordinatorConfig.policy"
    raw: bool = False  # text still to parse into the field's type (the environment)


Layer = Mapping[str, Setting]
"""Field path -> the value one source gives it; later layers win (`merge_layers`)."""


def _info(owner: type[Any], f: dataclasses.Field[Any], path: str, prefix: str) -> SettingInfo:
    # A field may name its own variable where two sections share a field name
    # (`seed`: KVMESH_SEED is the hash seed, KVMESH_MODEL_SEED the model's).
    env = f.metadata.get("env", prefix + f.name.upper())
    return SettingInfo(path, owner, f.name, env, str(f.type), f.default)


@functools.cache
def cluster_settings() -> dict[str, SettingInfo]:
    """Every field of `ClusterConfig` and its sections that a user sets, by path."""
    out: dict[str, SettingInfo] = {}
    for f in dataclasses.fields(ClusterConfig):
        section: Any = f.default_factory
        if section is dataclasses.MISSING:
            out[f.name] = _info(ClusterConfig, f, f.name, ENV_PREFIX)
            continue
        for g in dataclasses.fields(section):
            path = f"{f.name}.{g.name}"
            out[path] = _info(section, g, path, ENV_PREFIX)
    return out


def env_layer(env: Mapping[str, str] | None = None) -> dict[str, Setting]:
    """The ``KVMESH_*`` variables of `env` (default: this process's) that name a field.

    A ``KVMESH_*`` variable that names no field and is none of
    `kvmesh.environment.OTHER_VARIABLES` (a typo) is one `InvalidSetting` naming it.
    """
    env = os.environ if env is None else env
    settings = cluster_settings()
    refuse_unknown_variables(env, {info.env for info in settings.values()}, ENV_PREFIX)
    return {
        path: Setting(env[info.env], info.env, raw=True)
        for path, info in settings.items()
        if info.env in env
    }


def explicit_layer(
    values: Mapping[str, Any], names: Mapping[str, str] | None = None
) -> dict[str, Setting]:
    """Values given in code or by flags, by path; None means "not given".

    `names` says how the caller calls a path in errors (``{"coordinator.policy":
    "--policy"}``); otherwise errors name the field. An unknown path is a `ConfigError`.
    """
    settings = cluster_settings()
    out: dict[str, Setting] = {}
    for path, value in values.items():
        info = settings.get(path)
        if info is None:
            close = difflib.get_close_matches(path, settings, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown setting {path!r}{hint}")
        if value is not None:
            out[path] = Setting(value, (names or {}).get(path, info.qualified))
    return out


def merge_layers(*layers: Layer) -> dict[str, Setting]:
    """One value per path, a later layer winning (defaults < environment < explicit)."""
    merged: dict[str, Setting] = {}
    for layer in layers:
        merged.update(layer)
    return merged


def name_sources(error: InvalidSetting, given: Mapping[str, Setting]) -> InvalidSetting:
    """`error` again, naming the variable or flag each of its fields was set by.

    `given` maps qualified field names (``PoolConfig.num_pages``) or paths to
    settings. An error about fields nobody set, or set under their own name,
    comes back as it is.
    """
    by_field = dict(given)
    for path, info in cluster_settings().items():
        if path in given:
            by_field[info.qualified] = given[path]
    named = [(f, by_field[f]) for f in error.fields if f in by_field]
    if all(s.source == f for f, s in named):
        return error
    setting = ", ".join(f"{s.source}={s.value!r}" for _, s in named)
    return InvalidSetting(setting, f"{error.reason} ({', '.join(error.fields)})", error.fields)


def _parse(info: SettingInfo, setting: Setting) -> Any:
    """The typed value of `setting`; text (from the environment) is parsed by the field's type."""
    if not setting.raw:
        return setting.value
    text: str = setting.value
    if info.type == "str | None":
        return text or None  # KVMESH_TLS_CA= (empty) means unset
    if info.type == "str":
        return text
    word = text.strip().lower()
    try:
        if info.type == "bool":
            if word in _TRUE or word in _FALSE:
                return word in _TRUE
            raise ValueError(text)
        return int(word) if info.type == "int" else float(word)
    except ValueError:
        kind = _ACCEPTS[info.type][1]
        raise InvalidSetting(
            f"{setting.source}={text!r}", f"is not {kind} ({info.qualified})", (info.qualified,)
        ) from None


def build_cluster_config(given: Mapping[str, Setting]) -> ClusterConfig:
    """A `ClusterConfig` from its defaults and `given` (path -> setting, see `merge_layers`).

    Each section checks itself; an `InvalidSetting` names the variable or flag
    the bad value came from. Registry checks (policy, hash, transport names)
    are `kvmesh.settings.validate_cluster_config`'s.
    """
    settings = cluster_settings()
    top: dict[str, Any] = {}
    sections: dict[str, tuple[type[Any], dict[str, Any]]] = {}
    for path, setting in given.items():
        info = settings[path]
        value = _parse(info, setting)
        head, _, name = path.partition(".")
        if name:
            sections.setdefault(head, (info.owner, {}))[1][name] = value
        else:
            top[path] = value
    try:
        built = {head: owner(**kw) for head, (owner, kw) in sections.items()}
        return ClusterConfig(**top, **built)
    except InvalidSetting as exc:
        raise name_sources(exc, given) from None


def from_env(cls: type[T], prefix: str = ENV_PREFIX, **overrides: Any) -> T:
    """One section from its defaults, then its ``KVMESH_<FIELD>`` variables, then `overrides`.

    An override of None means "not given" and leaves the variable in force.
    Errors name the variable a bad value came from, as `build_cluster_config`'s do.
    """
    infos = {
        f.name: _info(cls, f, f.name, prefix)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
    }
    env = os.environ
    if prefix == ENV_PREFIX:  # a mistyped variable is refused here too (`env_layer`)
        known = {i.env for i in (*cluster_settings().values(), *infos.values())}
        refuse_unknown_variables(env, known, prefix)
    given = {n: Setting(env[i.env], i.env, raw=True) for n, i in infos.items() if i.env in env}
    for name, value in overrides.items():
        if name not in infos:
            raise ConfigError(f"{cls.__name__} has no setting {name!r}")
        if value is not None:
            given[name] = Setting(value, infos[name].qualified)
    try:
        return cls(**{n: _parse(infos[n], s) for n, s in given.items()})
    except InvalidSetting as exc:
        raise name_sources(exc, {infos[n].qualified: s for n, s in given.items()}) from None
