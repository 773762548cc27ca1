"""Configuration in one place: a dataclass per component.

Defaults fit a laptop (CPU, a few hundred pages). Every field can be set from
the environment as ``KVMESH_<FIELD>`` (upper case) through `from_env`, and the
CLI maps its flags onto the same fields, so a value means the same thing
wherever it is set. Components own their section; add fields there.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvmesh.errors import ConfigError

T = TypeVar("T")

DEFAULT_SEED = "kvmesh-default-seed"


@dataclass(frozen=True, slots=True)
class HashConfig:
    """Page identity: page size, cluster seed and hash function."""

    page_size: int = 16
    seed: str = DEFAULT_SEED
    algo: str = "sha256"  # or "xxh3_128"

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {self.page_size}")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Local page pool and cache manager."""

    num_pages: int = 512
    enable_caching: bool = True
    medium: str = "cpu"
    event_token_ids: bool = True  # PagesStored carries the pages' token ids
    use_eagle: bool = False  # drop the last matched page (EAGLE recomputes its hidden states)

    def __post_init__(self) -> None:
        if self.num_pages < 2:
            raise ConfigError(
                f"num_pages must be at least 2 (page 0 is the null page), got {self.num_pages}"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The small deterministic transformer every worker runs (shapes the KV tensors)."""

    vocab_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128
    max_positions: int = 8192
    seed: int = field(default=1234, metadata={"env": "KVMESH_MODEL_SEED"})
    dtype: str = "float32"
    device: str = "cpu"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    prefill_chunk_tokens: int = 512  # chunked prefill: tokens per model call (rounded to pages)


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Worker gRPC server and the transfer paths between workers."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    max_message_bytes: int = 64 * 1024 * 1024
    chunk_bytes: int = 1024 * 1024  # page bytes per FetchPages message (bench: 1-2 MiB best)
    deadline_s: float = 10.0
    keepalive_ms: int = 10_000
    transport: str = "grpc"  # or "dist"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # set: mutual TLS (clients must present a cert from this CA)
    auth_token: str | None = None
    tls_root_ca: str | None = None  # CA clients verify servers with; default tls_ca, then system
    tls_server_name: str | None = None  # name in the peers' certificates if not their host
    keepalive_timeout_ms: int = 5_000
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
    grpc_sync_fetch: bool = False  # SyncPeerClient: blocking streams, a thread each (many cores)
    grpc_malloc_tune: bool = False  # glibc: keep freed transfer buffers mapped (process-wide)
    # pulls read FetchPages off the socket straight into reserved KV pages (GPU pools: via
    # host memory); kvmesh.worker.grpc_wire: same gRPC call and server, ~2x grpcio's receive
    grpc_zero_copy: bool = True
    # smaller pulls stay on grpcio's reused connections (a zero-copy call opens its own:
    # ~2 ms on loopback; measured break-even 1-8 MiB)
    grpc_zero_copy_min_bytes: int = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """Coordinator actor, global index and routing."""

    namespace: str = "kvmesh"
    actor_name: str = "kvmesh-coordinator"
    policy: str = "kv_aware"
    overlap_weight: float = 1.0
    temperature: float = 0.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    max_restarts: int = -1
    # kv_aware: cost = overlap_weight * (pages to prefill + queue_weight * queued prefill pages)
    #                  + decode_weight * active decode pages
    # Dynamo weighs decode pages 1.0; decode steps do not delay a prefill in the time
    # model (full workers are avoided anyway), and on the bundled trace 1.0 cut the page hit
    # ratio from 0.32 to 0.25. Raise it when decode shares the accelerator with prefill.
    decode_weight: float = 0.0
    queue_weight: float = 1.0
    pull_cost: float = 0.16  # pulling a page / computing it (6.4 ms vs ~41 ms per 512 tokens)
    max_load_ratio: float = 0.0  # kv_aware bounded load: skip workers above ratio * mean (0: off)
    consistent_hash_pages: int = 4  # leading pages that form the affinity key
    consistent_hash_vnodes: int = 64
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


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """Deployment profile and tenant binding; `kvmesh.security` checks and applies them."""

    profile: str = "dev"  # "production": Ray token auth, gRPC TLS (mTLS) and a bearer token
    allow_remote: bool = False  # dev: bind beyond loopback (e.g. 0.0.0.0) only when set
    require_mtls: bool = True  # production: peers must present a certificate from tls_ca
    api_keys_file: str | None = None  # JSON/YAML {api_key: cache_salt}: salts bound to keys


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """What `KVMesh.connect()` starts: the whole embedded cluster."""

    num_workers: int = 4
    prefill_workers: int = 0
    decode_workers: int = 0
    hash: HashConfig = field(default_factory=HashConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)


def _coerce(name: str, raw: str, target: Any) -> Any:
    kind = target if isinstance(target, type) else type(target)
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError as exc:
        raise ConfigError(
            f"environment variable {name}={raw!r} is not a valid {kind.__name__}"
        ) from exc
    return raw


def from_env(cls: type[T], prefix: str = "KVMESH_", **overrides: Any) -> T:
    """Build `cls` from its defaults, then ``KVMESH_<FIELD>`` variables, then `overrides`.

    An override of None means "not given" and leaves the variable in force.
    """
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        # A field may name its own variable where two components share a field
        # name (`seed`: KVMESH_SEED is the hash seed, KVMESH_MODEL_SEED the model's).
        env_name = f.metadata.get("env", prefix + f.name.upper())
        if env_name in os.environ and overrides.get(f.name) is None:
            default = f.default if f.default is not dataclasses.MISSING else str
            if default is None:
                default = str
            values[f.name] = _coerce(env_name, os.environ[env_name], default)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)
