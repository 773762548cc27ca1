"""The gateway's configuration: its engines, and how it routes, waits and listens.

One dataclass, filled from `kvmesh gateway`'s flags (or built directly by
tests and benchmarks). Defaults fit one machine: loopback, two-second
connects, a generous read timeout for CPU engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvmesh.config import CoordinatorConfig
from kvmesh.errors import ConfigError
from kvmesh.types import WorkerId

HISTORY_POLICY = "approx_prefix"
"""The policy that sees no events: it routes from the gateway's own routing history."""

MESH_POLICY = "kv_mesh"
"""`kv_aware` for engines with kvmesh's KV connector: a prefix another engine holds can be
pulled to the chosen one through the mesh, so route, pull and recomputation are one cost."""


COST = "cost"
"""Placement by the policy's cost alone (`kv_aware`: prefill plus queued tokens, per request)."""
CONVERSATIONS = "conversations"
"""`routing.ConversationPlacement`: conversations stay, new ones go where fewer blocks were
stored lately (`kv_aware`'s default)."""
PLACEMENTS = (CONVERSATIONS, COST)


STORE_SUFFIX = "/store"


def store_worker_id(engine: str) -> WorkerId:
    """The index worker an engine's kvmesh store's events feed (its blocks, host tier)."""
    return WorkerId(engine + STORE_SUFFIX)


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """One engine behind the gateway: its HTTP base URL and its KV event sockets.

    `events` is vLLM's ``--kv-events-config`` ``endpoint`` (a ``tcp://`` one
    is bound by the gateway, an ``ipc://`` one is connected to); `replay` its
    ``replay_endpoint``. No `events`: the engine serves, but never gets
    affinity from the index. `store_events` / `store_replay`: the same for
    the kvmesh store beside an engine with kvmesh's connector (the store's
    ``--events`` / ``--events-replay``, `kvmesh.worker.store_events`): what
    the engine can load from it, which ``kv_mesh`` prices as a host-tier hit.
    """

    name: str
    url: str
    events: str | None = None
    replay: str | None = None
    store_events: str | None = None
    store_replay: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                f"engine {self.name!r}: {self.url!r} is not an http(s) URL "
                "(e.g. http://127.0.0.1:8000)"
            )
        if not self.name:
            raise ConfigError("an engine needs a non-empty name")
        if self.name.endswith(STORE_SUFFIX):
            raise ConfigError(
                f"engine name {self.name!r} must not end in {STORE_SUFFIX!r}: the gateway names "
                "an engine's store so"
            )
        if self.store_replay is not None and self.store_events is None:
            raise ConfigError(
                f"engine {self.name!r}: a store replay endpoint needs the store's events "
                "endpoint (--store-events) too"
            )

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything `Gateway` needs besides its tokenizer and hasher.

    `policy`: a coordinator policy name (`kv_aware`, `round_robin`, ...) over
    the index the engines' events build, or ``approx_prefix`` (kv_aware's
    cost over the gateway's own routing history, no events).
    `history_blocks`: how many blocks ``approx_prefix`` assumes each engine
    keeps (least recently routed first out); 0: unbounded.
    `shared_prefix_blocks`: leading blocks every conversation shares (a
    system prompt); a request no engine holds more of is placed on the
    engine that computed the fewest blocks (`routing.BalancedPlacement`,
    ``kv_aware`` and ``approx_prefix``); 0: the policy's cost alone.
    `placement`: ``conversations`` or ``cost`` (`routing.PLACEMENTS`); None: the policy's
    default (``conversations`` for ``kv_aware``, ``cost`` for the others).
    """

    engines: tuple[EngineTarget, ...]
    policy: str = "kv_aware"
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 300.0  # longest wait for an engine's next bytes
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    health_failures: int = 2  # slow or non-200 /health answers in a row before an engine is down
    max_body_bytes: int = 8 * 1024 * 1024
    history_blocks: int = 0
    shared_prefix_blocks: int = 0
    placement: str | None = None
    served_model: str | None = None  # default: the model the first engine serves
    decision_log: int = 4096  # routing decisions kept for GET /kvmesh/decisions (0: none)

    def __post_init__(self) -> None:
        if not self.engines:
            raise ConfigError("the gateway needs at least one engine (--engine URL)")
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ConfigError(f"engine names must be unique, got {names}")
        for name in ("connect_timeout_s", "request_timeout_s", "health_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.health_timeout_s > 0:
            raise ConfigError(f"health_timeout_s must be positive, got {self.health_timeout_s}")
        if self.health_failures < 1:
            raise ConfigError(f"health_failures must be >= 1, got {self.health_failures}")
        if self.max_body_bytes <= 0:
            raise ConfigError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.history_blocks < 0:
            raise ConfigError(f"history_blocks must be >= 0, got {self.history_blocks}")
        if self.shared_prefix_blocks < 0:
            raise ConfigError(f"shared_prefix_blocks must be >= 0, got {self.shared_prefix_blocks}")
        if self.placement is not None and self.placement not in PLACEMENTS:
            raise ConfigError(
                f"unknown placement {self.placement!r}; choose one of {list(PLACEMENTS)}"
            )
        if self.decision_log < 0:
            raise ConfigError(f"decision_log must be >= 0 records, got {self.decision_log}")
