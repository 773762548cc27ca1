"""What callers send the coordinator: one parameter object per call.

A worker registers with a `WorkerRegistration` and reports with a
`WorkerReport`; a client, the gateway or an engine asks where to send a
request with a `RouteQuery`. Each object crosses
every layer unchanged (client -> Ray actor or gRPC API -> router replica ->
index shard -> `Coordinator`), so a field is added in one place: here, plus
the proto message that carries it outside Ray.

Each checks itself when built. An object that crossed a Ray boundary was
unpickled without running its constructor, so the coordinator calls `check()`
again before it trusts one (cheap: a few comparisons, never per page).

`ReportMark` is how a route waits for the reports it depends on: a worker
answers a request with the seq of the last event batch it sent the
coordinator (`GenerationResult.reported`), and a client's next route carries
the marks of the answers it has read (`RouteQuery.after`); the coordinator
applies those batches before it decides (for at most a heartbeat interval),
so a follow-up request sees the pages its predecessor stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvmesh.errors import InvalidInput
from kvmesh.load import WorkerLoad
from kvmesh.requests import ROLES, ReportMark, Role, RouteOutcome
from kvmesh.types import PageHash, WorkerId

MAX_ID_CHARS = 256
"""The longest worker id, incarnation, address, tenant or request id accepted."""


def check_text(value: object, what: str, *, empty_ok: bool = False) -> None:
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, got {type(value).__name__}")
    if (not value and not empty_ok) or len(value) > MAX_ID_CHARS:
        raise InvalidInput(f"{what} must be 1-{MAX_ID_CHARS} characters, got {value!r:.60}")


def check_count(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"{what} must be a non-negative int, got {value!r:.40}")


@dataclass(frozen=True, slots=True)
class WorkerRegistration:
    """A worker (or engine) joining the cluster: where it serves, how big it is, which start.

    `capacity`: pages in its pool (0: unknown). `incarnation`: new per
    (re)start; a new one drops the old one's index entries. `actor_name` /
    `actor_namespace` name its Ray actor, so that a restarted coordinator can
    ask it for a snapshot (None for engines registered over gRPC).
    """

    worker_id: WorkerId
    address: str
    capacity: int
    incarnation: str
    role: Role = "both"
    actor_name: str | None = None
    actor_namespace: str | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> WorkerRegistration:
        """Itself, or `InvalidInput` naming the first bad field."""
        check_text(self.worker_id, "worker_id")
        check_text(self.address, "address", empty_ok=True)
        check_count(self.capacity, "capacity (pages)")
        check_text(self.incarnation, "incarnation")
        if self.role not in ROLES:
            raise InvalidInput(f"role must be one of {ROLES}, got {self.role!r:.40}")
        for name in ("actor_name", "actor_namespace"):
            value = getattr(self, name)
            if value is not None:
                check_text(value, name)
        return self


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What a worker tells the coordinator after a request and every heartbeat interval.

    `batches`: its encoded event batches (`kvmesh.events.encode_batch`), in seq
    order; `load`: its load now (None: keep the last); `outcomes`: what its
    requests reused against what their routes promised. The coordinator checks
    every batch and outcome before it applies any (`Coordinator.report`).
    """

    worker_id: WorkerId
    batches: Sequence[bytes] = ()  # kept as a tuple
    load: WorkerLoad | None = None
    outcomes: Sequence[RouteOutcome] = ()  # kept as a tuple

    def __post_init__(self) -> None:
        if not isinstance(self.batches, tuple):  # callers hand lists; one copy, kept
            object.__setattr__(self, "batches", tuple(self.batches))
        if not isinstance(self.outcomes, tuple):
            object.__setattr__(self, "outcomes", tuple(self.outcomes))
        self.check()

    def check(self) -> WorkerReport:
        """Itself, or `InvalidInput` naming the bad field (the batches' contents are the
        coordinator's to check)."""
        check_text(self.worker_id, "worker_id")
        for data in self.batches:
            if not isinstance(data, bytes):
                raise InvalidInput(f"an event batch must be bytes, got {type(data).__name__}")
        if self.load is not None and not isinstance(self.load, WorkerLoad):
            raise InvalidInput(f"load must be a WorkerLoad, got {type(self.load).__name__}")
        for outcome in self.outcomes:
            if not isinstance(outcome, RouteOutcome):
                raise InvalidInput(f"outcomes must be RouteOutcomes, got {type(outcome).__name__}")
        return self


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """Where should this request go: its page hashes, its size and what the caller allows.

    `hashes`: the prompt's chained full-page hashes. `role`: only workers
    serving it (None: any). `policy`: None for the coordinator's own.
    `request_id`: non-empty for a request on its way (its worker's load counts
    it at once); empty for a look that sends nothing. `tenant`
    (`kvmesh.tenants.tenant_of` the request's salt): when that tenant holds
    more than its fair share of the cluster's pages, `kv_aware` weighs the
    pages it would take from other tenants. `after`: reports to apply first
    (see the module docstring). `split`: both halves of a disaggregated request in
    one call, the prefill worker's decision with the decode worker's in its `decode`
    (`role` must then be None).
    """

    hashes: Sequence[PageHash]  # kept as a tuple
    num_tokens: int
    page_size: int = 16
    allow_pull: bool = False
    role: Role | None = None
    policy: str | None = None
    request_id: str = ""
    tenant: str | None = None
    after: tuple[ReportMark, ...] = ()
    split: bool = False

    def halves(self) -> tuple[RouteQuery, RouteQuery]:
        """A split query's two routes: among prefill workers, among decode workers."""
        whole = replace(self, split=False)
        return replace(whole, role="prefill"), replace(whole, role="decode")

    def __post_init__(self) -> None:
        if not isinstance(self.hashes, tuple):  # callers hand lists; one copy, kept
            object.__setattr__(self, "hashes", tuple(self.hashes))
        if not isinstance(self.after, tuple):
            object.__setattr__(self, "after", tuple(self.after))
        self.check()

    def check(self) -> RouteQuery:
        """Itself, or `InvalidInput` naming the first bad field (hash sizes are the API's).

        One expression on the way through (a route pays it once); the field by field
        walk only to explain a refusal."""
        if (
            type(self.num_tokens) is int
            and self.num_tokens >= 0
            and type(self.page_size) is int
            and self.page_size > 0
            and (self.role is None or self.role in ROLES)
            and (
                self.policy is None
                or (type(self.policy) is str and 0 < len(self.policy) <= MAX_ID_CHARS)
            )
            and type(self.request_id) is str
            and len(self.request_id) <= MAX_ID_CHARS
            and (
                self.tenant is None
                or (type(self.tenant) is str and 0 < len(self.tenant) <= MAX_ID_CHARS)
            )
            and (not self.after or all(type(m) is ReportMark for m in self.after))
            and (not self.split or self.role is None)
        ):
            return self
        return self._refuse()

    def _refuse(self) -> RouteQuery:
        check_count(self.num_tokens, "num_tokens")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int):
            raise InvalidInput(f"page_size must be an int, got {self.page_size!r:.40}")
        if self.page_size <= 0:
            raise InvalidInput(f"page_size must be positive, got {self.page_size}")
        if self.role is not None and self.role not in ROLES:
            raise InvalidInput(f"role must be one of {ROLES} or None, got {self.role!r:.40}")
        if self.policy is not None:
            check_text(self.policy, "policy")
        check_text(self.request_id, "request_id", empty_ok=True)
        if self.tenant is not None:
            check_text(self.tenant, "tenant")
        for mark in self.after:
            if not isinstance(mark, ReportMark):
                raise InvalidInput(f"after must hold ReportMarks, got {type(mark).__name__}")
        if self.split and self.role is not None:
            raise InvalidInput(
                f"a split query asks for both roles; give role None, not {self.role!r:.40}"
            )
        return self


__all__ = [
    "MAX_ID_CHARS",
    "ReportMark",
    "RouteQuery",
    "WorkerRegistration",
    "WorkerReport",
    "check_text",
]
