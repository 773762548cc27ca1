"""`KVMesh`: the Python API users call, over a Ray cluster (joined or embedded).

::

    from kvmesh.app import connect

    with connect() as mesh:                         # embedded local cluster, 4 workers
        r = mesh.generate("Hello", max_tokens=8)    # route, then serve on the chosen worker
        r.tokens, r.timings.ttft_ms, r.pages_hit_local

One request: the client hashes the prompt's pages (same seed and page size
as the workers), asks the coordinator actor for a `RouteDecision` (the one
coordinator call it makes), and calls the chosen worker actor with the
hashes and what the decision promised (local pages, and pages a peer could
give). The worker checks the hashes cheaply instead of hashing the prompt
again, and tells the coordinator what it really hit and pulled with its
report of the request's events (one call it does not wait for), so that
predicted vs realized is counted.

Read your writes: the answer names that report (`GenerationResult.reported`)
and this client's next route and stats carry it (`RouteQuery.after`), so the
coordinator applies it before deciding: a follow-up request finds the pages
its predecessor stored even when the report is still on its way. The wait is
bounded by a heartbeat interval (a lost report is resent with the next one).

The client holds only handles: `KVMesh.attach` joins a running cluster and
creates nothing; starting one (an embedded Ray, the coordinator, workers) is
the app's (`kvmesh.app.connect`, which returns a `KVMesh`), so nothing here
imports the app, the worker or the coordinator (tests/test_layering.py).

Failures: a worker that dies before answering is dropped from the
coordinator and the request is routed again, up to `retries` times (default
once); after that the caller gets `WorkerDied`. A request is never answered
from a half-finished run: the answer comes whole from one worker or not at
all. Errors raised by a worker (`KVMeshError`) reach the caller as the same
class, not wrapped.

Disaggregation (`prefill_workers`, `decode_workers`): the coordinator picks a
prefill worker and a decode worker in one route (`RouteQuery.split`); the prefill worker computes the prompt's
pages and pushes them to the decode worker over gRPC; the decode worker then
serves the request from them. The tokens are those of a normal run.

Sync methods run the async ones on a private event loop per call; inside a
running event loop use `agenerate` / `aroute` (they await object refs and
never block the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

from kvmesh.client import tokenizer
from kvmesh.config import ClusterConfig
from kvmesh.coordination import RouteQuery
from kvmesh.errors import (
    ClusterUnreachable,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    KVMeshError,
    MovedAPI,
    NoWorkers,
    WorkerDied,
)
from kvmesh.handles import CoordinatorHandle, RegisteredWorker, WorkerActorHandle
from kvmesh.hashing import ExtraKeys, PageHasher, reusable_pages
from kvmesh.logs import request_scope
from kvmesh.ray_address import RAY_ADDRESS_VARIABLE, address_from_environment, reachable
from kvmesh.requests import (
    GenerateRequest,
    GenerationResult,
    PrefillResult,
    ReportMark,
    Role,
    RouteDecision,
    WorkerStats,
)
from kvmesh.router_replicas import router_handles
from kvmesh.security import TenantPolicy, check_cluster
from kvmesh.settings import settings_for, validate_cluster_config
from kvmesh.tenants import tenant_of
from kvmesh.types import PageHash, WorkerId

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

T = TypeVar("T")
R = TypeVar("R", GenerationResult, PrefillResult)

Prompt = str | Sequence[int]

DEFAULT_WORKER_CPUS = 0.5
"""Ray CPUs per worker actor: small, so that 4 workers fit a 2-core laptop."""


@dataclass(frozen=True, slots=True)
class ClusterStats:
    """The cluster now: every reachable worker's stats and the coordinator's counters."""

    policy: str
    workers: tuple[WorkerStats, ...]
    coordinator: dict[str, Any]

    @property
    def requests(self) -> int:
        return sum(w.requests for w in self.workers)

    @property
    def prompt_pages(self) -> int:
        return sum(w.prompt_pages for w in self.workers)

    @property
    def page_hit_ratio(self) -> float:
        """Prompt pages served from the serving worker's own cache / all prompt pages."""
        pages = self.prompt_pages
        return sum(w.pages_hit_local for w in self.workers) / pages if pages else 0.0

    @property
    def pulled_pages(self) -> int:
        return sum(w.pages_pulled for w in self.workers)

    @property
    def mismatches(self) -> int:
        """Results whose realized local/pulled pages differed from the route's promise."""
        return int(self.coordinator.get("mismatches", 0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "page_hit_ratio": self.page_hit_ratio,
            "pulled_pages": self.pulled_pages,
            "mismatches": self.mismatches,
            "workers": [
                {**dataclasses.asdict(w), "page_hit_ratio": w.page_hit_ratio} for w in self.workers
            ],
            "coordinator": self.coordinator,
        }


@dataclass(slots=True)
class WorkerHandle:
    """A worker this client can call: its id, role, gRPC address and Ray actor handle."""

    worker_id: WorkerId
    role: str
    address: str
    actor: WorkerActorHandle


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise KVMeshError(
        "a blocking KVMesh method was called inside a running event loop; "
        "use the async variant (agenerate / aroute / astats)"
    )


def _unwrap(exc: BaseException) -> BaseException:
    """A worker's own exception out of Ray's wrapper (RayTaskError.cause)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class KVMesh:
    """A connection to a kvmesh cluster: `kvmesh.app.connect` builds one (starting what is
    missing), `KVMesh.attach` joins a running one."""

    def __init__(
        self,
        config: ClusterConfig,
        coordinator: CoordinatorHandle,
        workers: dict[WorkerId, WorkerHandle],
        *,
        owns_ray: bool,
        created: Sequence[WorkerId],
        retries: int,
        pull: bool,
        request_timeout_s: float,
        ray_address: str,
        tenants: TenantPolicy | None = None,
    ) -> None:
        self.config = config
        # Operator-bound salts: when API keys are configured, a request's salt comes
        # from its key and a salt the caller sends is ignored (docs/security.md).
        self.tenants = (
            tenants if tenants is not None else TenantPolicy.from_env(security=config.security)
        )
        self.hasher = PageHasher.from_config(config.hash)
        self.policy = config.coordinator.policy
        self.retries = retries
        self.pull = pull
        self.request_timeout_s = request_timeout_s
        self.ray_address = ray_address
        self._coordinator = coordinator
        self._workers = workers
        self._owns_ray = owns_ray
        # The owner's handles of the workers this client created: Ray destroys a
        # non-detached actor once its owner drops every handle, so they are kept here
        # until `close`, whatever happens to the routing table in `_workers`.
        self._owned: dict[WorkerId, WorkerActorHandle] = {
            wid: workers[wid].actor for wid in created
        }
        self._lock = threading.Lock()
        self._reported: dict[WorkerId, ReportMark] = {}  # answers' reports not yet routed after
        self._closed = False

    # ---------------------------------------------------------------- connect

    @classmethod
    def connect(cls, address: str | None = None, **options: Any) -> NoReturn:
        """Moved: `kvmesh.app.connect(address, **options)` starts what is missing and returns
        the `KVMesh`; `KVMesh.attach` joins a running cluster. Starting a cluster is the
        app's job, and the client imports nothing of the app, so this only says where to go.
        """
        raise MovedAPI(
            "KVMesh.connect moved to the app: `from kvmesh.app import connect`, then "
            "`connect(address, **options)` (same arguments; it starts Ray, the coordinator "
            "and the workers when missing), or `KVMesh.attach(address)` to join a running "
            "cluster without creating anything"
        )

    @classmethod
    def attach(
        cls,
        address: str | None = None,
        *,
        config: ClusterConfig | None = None,
        config_file: str | Path | None = None,
        source: str = "address",
        retries: int = 1,
        pull: bool = True,
        request_timeout_s: float = 120.0,
        tenants: TenantPolicy | None = None,
    ) -> KVMesh:
        """A client of the kvmesh cluster running at `address` (or ``RAY_ADDRESS``; or the
        Ray this process already joined); nothing is created.

        Refuses with `ClusterUnreachable` within seconds when no Ray answers there
        (`kvmesh.ray_address.reachable`) or when Ray runs but no kvmesh coordinator
        does in the config's namespace; `source` names the address in errors
        (``--address``). Settings as `kvmesh.app.connect` reads them.
        """
        import ray

        cfg = settings_for(config, config_file)
        check_cluster(cfg)
        cls.check_client_options(retries, request_timeout_s)
        owns_ray = False
        if not ray.is_initialized():
            if address is None and (address := address_from_environment()) is not None:
                source = RAY_ADDRESS_VARIABLE
            if address is None:
                raise ClusterUnreachable(
                    "no cluster address: give one (HOST:PORT) or set RAY_ADDRESS"
                )
            cls.join_ray(address, cfg, source)
            owns_ray = True
        try:
            ns, name = cfg.coordinator.namespace, cfg.coordinator.actor_name
            try:
                coordinator: CoordinatorHandle = ray.get_actor(name, namespace=ns)
            except ValueError:
                where = ray.get_runtime_context().gcs_address
                raise ClusterUnreachable(
                    f"Ray runs at {where} but kvmesh does not: no coordinator {name!r} in "
                    f"namespace {ns!r}; start it there with `kvmesh start --address {where}`"
                ) from None
            ray.get(coordinator.wait_ready.remote(), timeout=120)
            workers = attach_workers(ray.get(coordinator.workers.remote(), timeout=60))
            ray_address = ray.get_runtime_context().gcs_address
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise
        return cls(
            cfg,
            coordinator,
            workers,
            owns_ray=owns_ray,
            created=(),
            retries=retries,
            pull=pull,
            request_timeout_s=request_timeout_s,
            ray_address=ray_address,
            tenants=tenants,
        )

    @staticmethod
    def join_ray(address: str, config: ClusterConfig, source: str = "address") -> None:
        """`ray.init` this process into the cluster at `address`, once its GCS port answered
        (`ClusterUnreachable` within `config.connect_timeout_s` otherwise); Ray's refusal is
        a `ConfigError`."""
        import ray

        resolved = reachable(address, source, config.connect_timeout_s)
        try:
            ray.init(
                address=resolved,
                namespace=config.coordinator.namespace,
                log_to_driver=False,
                logging_level=logging.WARNING,  # not Ray's "Connecting to ..." lines
            )
        except (ConnectionError, ValueError, RuntimeError) as exc:
            hint = ""
            if os.environ.get("RAY_AUTH_MODE", "") != "token":
                hint = (
                    " (a cluster with Ray token authentication needs RAY_AUTH_MODE=token "
                    "and its token in ~/.ray/auth_token or RAY_AUTH_TOKEN)"
                )
            raise ConfigError(
                f"cannot join the Ray cluster at {source}={address!r}: {exc}{hint}"
            ) from None

    @staticmethod
    def check_client_options(retries: int, request_timeout_s: float) -> None:
        """Refuse (`ConfigError`) the client's own options before anything starts."""
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"retries must be an integer >= 0, got {retries!r}")
        if not request_timeout_s > 0:
            raise ConfigError(f"request_timeout_s must be positive, got {request_timeout_s}")

    def close(self) -> None:
        """Stop the workers this client created, then leave (or stop) Ray. Idempotent."""
        if self._closed:
            return
        self._closed = True
        import ray

        if not ray.is_initialized():
            return
        try:
            for wid, actor in self._owned.items():
                # A dead worker has nothing to stop; a gone coordinator nothing to forget.
                with contextlib.suppress(Exception):
                    ray.get(actor.shutdown.remote(), timeout=10)
                with contextlib.suppress(Exception):
                    ray.get(self._coordinator.remove_worker.remote(wid), timeout=10)
                with contextlib.suppress(Exception):
                    # the protocol is a view of the real handle Ray gave us
                    ray.kill(cast("ActorHandle[Any]", actor), no_restart=True)
        finally:
            if self._owns_ray:
                ray.shutdown()

    def __enter__(self) -> KVMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- requests

    def tokens(self, prompt: Prompt) -> list[int]:
        """Token ids of `prompt` (text: byte-level), checked against the model's vocabulary."""
        if isinstance(prompt, str):
            tokens = tokenizer.encode(prompt)
        elif isinstance(prompt, bytes | bytearray):
            raise InvalidInput("give the prompt as text (str) or token ids, not bytes")
        else:
            tokens = list(prompt)
        if not tokens:
            raise InvalidInput("the prompt is empty: give at least one token")
        vocab = self.config.model.vocab_size
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidInput(f"token ids must be integers in [0, {vocab}), got {t!r}")
        return tokens

    def hashes(
        self,
        tokens: Sequence[int],
        cache_salt: str | None = None,
        lora_id: int | None = None,
        *,
        api_key: str | None = None,
    ) -> list[PageHash]:
        """The chained page hashes the workers will compute for this prompt (and tenant)."""
        salt = self.tenants.resolve_salt(api_key, cache_salt)
        return self.hasher.hash_prompt(tokens, ExtraKeys(lora_id=lora_id, cache_salt=salt))

    def generate(
        self,
        prompt: Prompt,
        max_tokens: int = 16,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        *,
        api_key: str | None = None,
    ) -> GenerationResult:
        """Route and serve one request; returns the worker's `GenerationResult`."""
        return _run(self.agenerate(prompt, max_tokens, cache_salt, lora_id, api_key=api_key))

    def route(
        self,
        prompt: Prompt,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        *,
        role: Role | None = None,
        api_key: str | None = None,
    ) -> RouteDecision:
        """The coordinator's `RouteDecision` for `prompt` (nothing is served)."""
        return _run(self.aroute(prompt, cache_salt, lora_id, role=role, api_key=api_key))

    def stats(self) -> ClusterStats:
        return _run(self.astats())

    async def aroute(
        self,
        prompt: Prompt,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        *,
        role: Role | None = None,
        api_key: str | None = None,
    ) -> RouteDecision:
        tokens = self.tokens(prompt)
        salt = self.tenants.resolve_salt(api_key, cache_salt)
        hashes = self.hasher.hash_prompt(tokens, ExtraKeys(lora_id=lora_id, cache_salt=salt))
        return await self._route(self._query(tokens, hashes, role, "", salt))

    async def agenerate(
        self,
        prompt: Prompt,
        max_tokens: int = 16,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        *,
        api_key: str | None = None,
    ) -> GenerationResult:
        """Async `generate`: awaits object refs, never blocks the event loop."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidInput(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
        if lora_id is not None and (isinstance(lora_id, bool) or not isinstance(lora_id, int)):
            raise InvalidInput(f"lora_id must be an integer or None, got {lora_id!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidInput(f"cache_salt must be a string or None, got {cache_salt!r}")
        tokens = self.tokens(prompt)
        cache_salt = self.tenants.resolve_salt(api_key, cache_salt)
        hashes = self.hasher.hash_prompt(tokens, ExtraKeys(lora_id=lora_id, cache_salt=cache_salt))
        base = GenerateRequest(
            uuid.uuid4().hex,
            tuple(tokens),
            max_tokens,
            cache_salt,
            lora_id,
            timeout_s=self.request_timeout_s,  # each worker call waits this long (`_call`)
            caller_job=_caller_job(),
            page_hashes=tuple(hashes),
        )
        disaggregated = self.config.prefill_workers > 0 and self.config.decode_workers > 0
        last: BaseException | None = None
        with request_scope(base.request_id):  # its id on our logs and on the error we raise
            for _attempt in range(self.retries + 1):
                try:
                    if disaggregated:
                        return await self._disaggregated(base, hashes)
                    return await self._serve(base, hashes)
                except _Died as died:
                    last = died.error
                    await self._forget(died.worker_id)
            raise WorkerDied(
                f"the worker serving the request died and {self.retries} retries on other "
                f"workers failed too ({last}); no answer was produced"
            )

    async def astats(self) -> ClusterStats:
        with self._lock:  # the counters once the reports of the answers read are in
            after = tuple(self._reported.values())
        coord = await self._call(self._coordinator.stats.remote(after), None)
        workers = list(self._workers.values())
        results = await asyncio.gather(
            *(self._call(w.actor.stats.remote(), w.worker_id) for w in workers),
            return_exceptions=True,
        )
        alive = tuple(r for r in results if not isinstance(r, BaseException))
        return ClusterStats(self.policy, alive, coord)

    # ---------------------------------------------------------------- control

    def set_policy(self, policy: str) -> None:
        """Route this client's next requests with `policy` (a name in the coordinator's registry;
        `InvalidSetting` naming it otherwise, checked as a setting is)."""
        coordinator = dataclasses.replace(self.config.coordinator, policy=policy)
        validate_cluster_config(dataclasses.replace(self.config, coordinator=coordinator))
        self.policy = policy

    def reset(self, policy: str | None = None) -> None:
        """Empty every worker's cache (their events clear the index); optionally switch policy."""
        import ray

        if policy is not None:
            self.set_policy(policy)
        ray.get([w.actor.reset_cache.remote() for w in self._workers.values()], timeout=60)

    def workers(self) -> list[dict[str, str]]:
        """Id, role and gRPC address of every worker this client knows."""
        return [
            {"worker_id": w.worker_id, "role": w.role, "address": w.address}
            for w in self._workers.values()
        ]

    def worker(self, worker_id: str) -> WorkerActorHandle:
        """The Ray actor handle of a worker (for tests and tools)."""
        try:
            return self._workers[WorkerId(worker_id)].actor
        except KeyError:
            raise InvalidInput(
                f"unknown worker {worker_id!r}; known: {sorted(self._workers)}"
            ) from None

    # ---------------------------------------------------------------- internals

    async def _call(self, ref: ObjectRef[T], worker_id: WorkerId | None) -> T:
        """Await `ref` within the request deadline; map Ray's failures to kvmesh errors.

        A worker's task this client stops waiting for (the deadline passed, or the
        awaiting task was cancelled, e.g. by Ctrl-C) is cancelled on the worker
        too: awaiting an object ref with a timeout does not do that by itself.
        """
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        try:
            return await asyncio.wait_for(ref, self.request_timeout_s)
        except asyncio.CancelledError:
            if worker_id is not None:
                _cancel_task(ref)
            raise
        except TimeoutError:
            if worker_id is not None:
                _cancel_task(ref)
            raise DeadlineExceeded(
                f"{'worker ' + worker_id if worker_id else 'the coordinator'} did not answer "
                f"within {self.request_timeout_s:.0f}s"
            ) from None
        except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
            if worker_id is None:
                raise NoWorkers(f"the coordinator actor is unavailable: {exc}") from None
            raise _Died(worker_id, exc) from None
        except Exception as exc:
            cause = _unwrap(exc)
            if isinstance(cause, KVMeshError):
                raise cause from None
            raise

    def _query(
        self,
        tokens: Sequence[int],
        hashes: Sequence[PageHash],
        role: Role | None,
        rid: str,
        salt: str | None,
    ) -> RouteQuery:
        """The route query of a prompt: its tenant (by salt), and the reports of the answers
        this client has read, so that the route sees the pages they stored (`_follow`)."""
        with self._lock:
            after = tuple(self._reported.values())
        return RouteQuery(
            tuple(hashes),
            len(tokens),
            self.config.hash.page_size,
            self.pull,
            role,
            self.policy,
            rid,
            tenant_of(salt),
            after,
        )

    def _follow(self, result: R) -> R:
        """Keep the report `result` followed (`GenerationResult.reported`): this client's
        next route waits for it, so a follow-up request finds what this one stored."""
        mark = result.reported
        if mark is not None:
            with self._lock:
                known = self._reported.get(mark.worker_id)
                if known is None or known.incarnation != mark.incarnation or known.seq < mark.seq:
                    self._reported[mark.worker_id] = mark
        return result

    async def _route(self, query: RouteQuery) -> RouteDecision:
        decision = await self._route_anywhere(query)
        with self._lock:  # a route that waited for a mark saw it: later routes need not wait
            for mark in query.after:
                if self._reported.get(mark.worker_id) is mark:
                    del self._reported[mark.worker_id]
        return decision

    async def _route_anywhere(self, query: RouteQuery) -> RouteDecision:
        try:
            return await self._call(self._coordinator.route.remote(query), None)
        except NoWorkers:
            if self.config.coordinator.router_replicas <= 1:
                raise
        # Router replica 0 is away: fail over to the others, which decide what it would have
        # decided (kvmesh.coordinator.router); their names are the base's.
        cfg = self.config.coordinator
        replicas = await asyncio.to_thread(router_handles, cfg, range(1, cfg.router_replicas))
        for i, router in enumerate(replicas):
            try:
                return await self._call(router.route.remote(query), None)
            except NoWorkers:
                if i == len(replicas) - 1:
                    raise
        raise NoWorkers("no coordinator router replica answered")

    async def _handle(self, worker_id: WorkerId) -> WorkerHandle:
        w = self._workers.get(worker_id)
        if w is None:  # registered after we connected (or by another client)
            infos = await self._call(self._coordinator.workers.remote(), None)
            # ray.get_actor blocks on the GCS: keep it off the event loop
            found = await asyncio.get_running_loop().run_in_executor(None, attach_workers, infos)
            with self._lock:
                for wid, got in found.items():
                    # Keep the handle already held for the same actor: for a worker this
                    # client created it is the owner's handle, and Ray destroys an actor
                    # once its owner drops it (a get_actor handle does not keep it alive).
                    known = self._workers.get(wid)
                    if known is None or known.actor._actor_id != got.actor._actor_id:
                        self._workers[wid] = got
            w = self._workers.get(worker_id)
        if w is None:  # gone (killed, or forgotten by a concurrent request): route again
            raise _Died(
                worker_id,
                NoWorkers(f"the coordinator routed to {worker_id!r}, whose actor is gone"),
            )
        return w

    def _promise(self, decision: RouteDecision, num_tokens: int) -> tuple[int, int, str | None]:
        """What a worker can really reuse of the decision: never the prompt's last token."""
        limit = reusable_pages(num_tokens, self.config.hash.page_size)
        local = min(decision.local_pages, limit)
        if not self.pull or decision.peer_id is None or decision.peer_pages <= 0:
            return local, 0, None
        peer = self._workers.get(decision.peer_id)
        pull = min(decision.peer_pages, limit - local)
        if peer is None or pull <= 0:
            return local, 0, None
        return local, pull, peer.address

    async def _serve(self, base: GenerateRequest, hashes: Sequence[PageHash]) -> GenerationResult:
        decision = await self._route(
            self._query(base.token_ids, hashes, None, base.request_id, base.cache_salt)
        )
        w = await self._handle(decision.worker_id)
        local, pull, peer = self._promise(decision, len(base.token_ids))
        request = dataclasses.replace(
            base, promised_local=local, promised_pull=pull, peer_address=peer
        )
        return self._follow(await self._call(w.actor.generate.remote(request), w.worker_id))

    async def _disaggregated(
        self, base: GenerateRequest, hashes: Sequence[PageHash]
    ) -> GenerationResult:
        n = len(base.token_ids)
        query = self._query(base.token_ids, hashes, None, base.request_id, base.cache_salt)
        pre_d = await self._route(dataclasses.replace(query, split=True))  # both halves
        dec_d = pre_d.decode
        if dec_d is None:  # pragma: no cover - a split query is always answered with both
            raise NoWorkers("the coordinator named no decode worker for a split route")
        pre_w = await self._handle(pre_d.worker_id)
        dec_w = await self._handle(dec_d.worker_id)
        local, pull, peer = self._promise(pre_d, n)
        pre_req = dataclasses.replace(
            base, promised_local=local, promised_pull=pull, peer_address=peer
        )
        # The decode worker takes pushed pages only under its own grant for this request.
        ticket = await self._call(dec_w.actor.expect_push.remote(base), dec_w.worker_id)
        pre = await self._call(
            pre_w.actor.prefill.remote(pre_req, dec_w.address, ticket), pre_w.worker_id
        )
        self._follow(pre)
        limit = reusable_pages(n, self.config.hash.page_size)
        promised = min(limit, max(dec_d.local_pages, pre.pages_pushed))
        dec_req = dataclasses.replace(base, promised_local=promised)
        return self._follow(await self._call(dec_w.actor.generate.remote(dec_req), dec_w.worker_id))

    async def _forget(self, worker_id: WorkerId) -> None:
        """Drop a dead worker here and at the coordinator (so it is not routed to again)."""
        with self._lock:
            self._workers.pop(worker_id, None)
        with contextlib.suppress(KVMeshError):
            await self._call(self._coordinator.remove_worker.remote(worker_id), None)


class _Died(Exception):
    """Internal: the actor of `worker_id` died during a call (retried or turned into WorkerDied)."""

    def __init__(self, worker_id: WorkerId, error: BaseException) -> None:
        super().__init__(f"worker {worker_id} died: {error}")
        self.worker_id = worker_id
        self.error = error


def _cancel_task(ref: ObjectRef[Any]) -> None:
    """Ask Ray to stop the actor task behind `ref` (its children, e.g. the worker's reports
    to the coordinator, finish); a task already done or gone has nothing to stop."""
    import ray

    with contextlib.suppress(Exception):
        ray.cancel(ref, recursive=False)


def _caller_job() -> str | None:
    """This process's Ray job id: a worker stops the requests of a caller whose job died."""
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_job_id()


def attach_workers(infos: Sequence[RegisteredWorker]) -> dict[WorkerId, WorkerHandle]:
    """Handles of registered workers whose Ray actors can be found by name."""
    import ray

    out: dict[WorkerId, WorkerHandle] = {}
    for info in infos:
        if not info.actor_name:
            continue
        try:
            actor = ray.get_actor(info.actor_name, namespace=info.actor_namespace)
        except ValueError:  # registered, but its actor is gone
            continue
        out[info.worker_id] = WorkerHandle(info.worker_id, info.role, info.address, actor)
    return out
