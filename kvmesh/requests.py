"""What a worker is built from and what it is asked and answers: the types components share.

The client builds `GenerateRequest`s, reads the coordinator's `RouteDecision`,
the worker's `GenerationResult` and `WorkerStats`; the coordinator registers
workers by `Role`; the worker serves them. They live here, in the
base, so that no component imports another to speak to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvmesh.config import ClusterConfig
from kvmesh.errors import InvalidInput
from kvmesh.hashing import ExtraKeys
from kvmesh.types import PageHash, WorkerId

Role = Literal["prefill", "decode", "both"]
"""Which half of a request a worker serves: "both" (the default), or one half of disaggregation."""
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker actor is built from: its id, role and the cluster config."""

    worker_id: WorkerId
    config: ClusterConfig = field(default_factory=ClusterConfig)
    role: Role = "both"
    torch_threads: int = 1
    max_concurrent: int = 1  # requests computing at once; the others queue
    page_delay_s: float = 0.0  # test hook: slow down every page this worker streams out

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise InvalidInput(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        if self.role not in ROLES:
            raise InvalidInput(f"role must be one of {ROLES}, got {self.role!r}")
        if self.torch_threads < 1 or self.max_concurrent < 1:
            raise InvalidInput("torch_threads and max_concurrent must be >= 1")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One request as a worker receives it: tokens, answer length, tenant keys, route promise.

    `promised_local` / `promised_pull` are what the route decision promised
    (already clamped to what a worker can reuse: never the prompt's last
    token); `peer_address` is the gRPC address of the worker holding the
    pullable pages, None for no pull.

    `timeout_s`: how long the caller waits for the answer; the worker stops the
    request that long after it arrives (a remaining budget, not a time of day,
    so that clocks of different nodes need not agree). `caller_job`: the
    caller's Ray job id (hex), so that the worker stops the request when the
    caller's process is gone. None: no limit / not watched.

    `page_hashes`: the prompt's chained page hashes as the client computed them
    to route it, so that the worker need not hash the prompt again; it checks
    them cheaply (`RequestHashes.given`) and hashes the tokens itself only when
    they are missing (empty) or disagree.
    """

    request_id: str
    token_ids: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    lora_id: int | None = None
    promised_local: int = 0
    promised_pull: int = 0
    peer_address: str | None = None
    timeout_s: float | None = None
    caller_job: str | None = None
    page_hashes: tuple[PageHash, ...] = ()

    @property
    def extra_keys(self) -> ExtraKeys:
        return ExtraKeys(lora_id=self.lora_id, cache_salt=self.cache_salt)


@dataclass(frozen=True, slots=True)
class RouteOutcome:
    """What a worker made of a route's promise: pages promised vs pages it really reused.

    The worker sends it with its next report (one call, not awaited by the
    request), so that predicted vs realized is counted without a call of its
    own; a difference is a mismatch (e.g. router and worker hash differently).
    """

    promised_local: int
    promised_pull: int
    realized_local: int
    realized_pull: int

    def check(self) -> RouteOutcome:
        """Itself, or `InvalidInput` when a count is not a non-negative int (it crossed a
        process boundary, so its constructor may not have run)."""
        for name in ("promised_local", "promised_pull", "realized_local", "realized_pull"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise InvalidInput(f"route outcome {name} must be a non-negative int, got {v!r}")
        return self

    @property
    def kept(self) -> bool:
        """Whether the worker reused exactly what the route promised."""
        return (self.promised_local, self.promised_pull) == (
            self.realized_local,
            self.realized_pull,
        )


@dataclass(frozen=True, slots=True)
class ReportMark:
    """A worker's event batch `seq` of `incarnation`: what a later route may wait to see applied.

    A worker answers a request with the mark of the last batch it sent the
    coordinator (`GenerationResult.reported`); a client's next route carries
    the marks of the answers it read (`kvmesh.coordination.RouteQuery.after`),
    so that it sees the pages its earlier requests stored.
    """

    worker_id: WorkerId
    incarnation: str
    seq: int

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> ReportMark:
        """Itself, or `InvalidInput` naming the bad field (it may come from outside Ray)."""
        for name in ("worker_id", "incarnation"):
            v = getattr(self, name)
            if not isinstance(v, str) or not 0 < len(v) <= 256:
                raise InvalidInput(f"report mark {name} must be 1-256 characters, got {v!r:.60}")
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 0:
            raise InvalidInput(f"report mark seq must be a non-negative int, got {self.seq!r:.40}")
        return self


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where the coordinator sends a request and what it can reuse there.

    `local_pages`: the prefix the chosen worker holds (as far as the index
    trusts it). `peer_id`/`peer_pages`: a worker holding a longer prefix and
    how many pages beyond `local_pages` it could give. `degraded`: the worker
    was picked from stale, full or draining workers because no healthy one was
    left. The coordinator's policies make it; clients read it.
    """

    worker_id: WorkerId
    local_pages: int
    peer_id: WorkerId | None
    peer_pages: int
    total_pages: int
    policy: str
    cost: float = 0.0
    degraded: bool = False
    promote_pages: int = 0
    """Pages of `local_pages` in the worker's host or disk tier, to promote (`kv_aware`)."""
    decode: RouteDecision | None = None
    """For a query asking both halves of a disaggregated request (`RouteQuery.split`): this
    decision is the prefill worker's, and this the decode worker's."""


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Milliseconds: queue (arrival to start), pull, prefill, to first token, total."""

    queue_ms: float
    pull_ms: float
    prefill_ms: float
    ttft_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A worker's answer and how it was produced: pages hit, pulled, computed vs promised.

    Page counts are over the prompt's pages (the last, partial one included):
    ``pages_hit_local + pages_pulled + pages_computed == ceil(prompt_tokens / page_size)``.
    """

    request_id: str
    worker_id: WorkerId
    tokens: tuple[int, ...]
    timings: RequestTimings
    prompt_tokens: int
    cached_tokens: int
    pages_hit_local: int
    pages_pulled: int
    pages_computed: int
    promised_local: int
    promised_pull: int
    pull_error: str | None = None
    reported: ReportMark | None = None
    """The last event batch the worker sent before answering (None: it reports to no
    coordinator): a client's next route waits for it (`RouteQuery.after`)."""


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill worker did for one request before handing it to a decode worker."""

    request_id: str
    worker_id: WorkerId
    pages_hit_local: int
    pages_pulled: int
    pages_computed: int
    pages_pushed: int
    prefill_ms: float
    push_ms: float
    push_error: str | None = None
    reported: ReportMark | None = None
    """As `GenerationResult.reported`: the prefill worker's last report before answering."""


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker's state and counters since it started."""

    worker_id: WorkerId
    role: str
    address: str
    incarnation: str
    num_pages: int
    pages_used: int
    pages_free: int
    cached_pages: int
    running: int
    waiting: int
    requests: int
    errors: int
    prompt_pages: int
    pages_hit_local: int
    pages_pulled: int
    pages_computed: int
    pages_pushed: int
    batches_sent: int
    snapshots_sent: int
    last_seq: int
    draining: bool
    pulls_grpc: int = 0  # pulls delivered over gRPC (a dist fallback counts here too)
    pulls_dist: int = 0  # pulls delivered over torch.distributed
    pushes_grpc: int = 0
    pushes_dist: int = 0
    dist_fallbacks: int = 0  # torch.distributed transfers that failed and went over gRPC
    links_opened: int = 0  # torch.distributed links this worker opened (client end)
    links_served: int = 0  # torch.distributed links peers opened to this worker
    requests_cancelled: int = 0  # stopped before answering: cancelled, deadline, caller gone

    @property
    def page_hit_ratio(self) -> float:
        """Prompt pages served from this worker's own cache / all its prompt pages."""
        return self.pages_hit_local / self.prompt_pages if self.prompt_pages else 0.0


__all__ = [
    "ROLES",
    "GenerateRequest",
    "GenerationResult",
    "PrefillResult",
    "ReportMark",
    "RequestTimings",
    "Role",
    "RouteDecision",
    "RouteOutcome",
    "WorkerSpec",
    "WorkerStats",
]
