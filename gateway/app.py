"""The gateway: an OpenAI-compatible HTTP server that routes each request to an engine.

Per request (one pass, on the event loop): check the body, resolve the
tenant's ``cache_salt``, tokenize once (a chat request through the chat
template), hash the full blocks as the engines do, ask the router for an
engine among those up, and forward the prompt as token ids to the engine's
``/v1/completions``. The answer (or its SSE stream) goes back unchanged for
completions and reshaped for chat. Response headers name the engine
(``x-kvmesh-engine``) and the blocks the router expected it to hold
(``x-kvmesh-matched-blocks``; under ``kv_mesh`` also those it loads from its
store, ``x-kvmesh-store-blocks``, and pulls, ``x-kvmesh-pull-blocks``).

Failures: a request whose engine cannot be reached (connection refused:
the engine is marked down) or breaks off before answering (the engine is
health-checked at once) goes to the next best engine (nothing was returned
to the caller yet, and a completion has no side effects); with none left
the caller gets 503. Every upstream call has a
connect and a read timeout (504 when it passes). Bad bodies get 4xx JSON
errors in OpenAI's shape (`kvmesh.gateway.openai`), never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import RouteDecision, RouteRequest
from kvmesh.engine_hash import EngineExtraKeys, EngineHasher
from kvmesh.errors import (
    DeadlineExceeded,
    InvalidInput,
    KVMeshError,
    MessageTooLarge,
    NoWorkers,
    TransportError,
    UnknownModel,
)
from kvmesh.gateway.config import MESH_POLICY, EngineTarget, GatewayConfig, store_worker_id
from kvmesh.gateway.decisions import DECISION_HEADER, DecisionLog, cached_tokens, usage_in_sse
from kvmesh.gateway.engines import EnginePool, EngineState, Ticket
from kvmesh.gateway.openai import (
    ChatStreamTranslator,
    PreparedRequest,
    chat_from_completion,
    error_body,
    http_status,
    parse_json_body,
    prepare_chat,
    prepare_completion,
    served_models,
    sse,
)
from kvmesh.gateway.routing import MeshHeld, Router, make_router, tie_break_key
from kvmesh.gateway.tokenizer import PromptTokenizer
from kvmesh.metrics import (
    GATEWAY_FIRST_BYTE,
    GATEWAY_MATCHED_BLOCKS,
    GATEWAY_PROMPT_BLOCKS,
    GATEWAY_PULL_BLOCKS,
    GATEWAY_REQUESTS,
    GATEWAY_RETRIES,
    GATEWAY_REUSED_BLOCKS,
    GATEWAY_ROUTED,
    GATEWAY_STORE_BLOCKS,
)
from kvmesh.security import TenantPolicy
from kvmesh.types import PageHash, WorkerId

log = logging.getLogger(__name__)

ENGINE_HEADER = "x-kvmesh-engine"
MATCHED_HEADER = "x-kvmesh-matched-blocks"
PULL_HEADER = "x-kvmesh-pull-blocks"  # kv_mesh: blocks predicted pulled through the mesh
PULL_FROM_HEADER = "x-kvmesh-pull-from"  # ... from this engine's store
STORE_HEADER = "x-kvmesh-store-blocks"  # kv_mesh: blocks predicted loaded from its own store

_UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout)
"""Nothing listens (the engine died): it is down, whatever it cached is gone."""
_BROKE_OFF = (httpx.RemoteProtocolError, httpx.ReadError)
"""The engine broke off before answering: it died, or closed an idle kept-alive connection
as the request went out. Either way the request goes to another engine and a health check
decides about this one."""


EngineCheck = Callable[[EngineTarget], Awaitable[object]]
"""A check an engine must pass before its events are trusted (the hash-parity canary)."""


class EventSource(Protocol):
    """Something that keeps the gateway's index in step with an engine (a KV event subscriber)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Gateway:
    """The routing core behind the HTTP routes; `start`/`stop` own its tasks and client.

    `hasher` must be configured as the engines are (algorithm, seed, block
    size, int hashes): all engines behind one gateway share it. `index` is
    the one the `sources` feed; the router reads it (or, for
    ``approx_prefix``, keeps its own history instead). `verify` runs for
    each engine when it is first seen up and after every time it was down.
    """

    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: PromptTokenizer,
        hasher: EngineHasher,
        *,
        index: GlobalIndex | None = None,
        sources: Sequence[EventSource] = (),
        tenants: TenantPolicy | None = None,
        verify: EngineCheck | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.index = index if index is not None else GlobalIndex()
        self.sources = list(sources)
        self.tenants = tenants if tenants is not None else TenantPolicy()
        stores = {
            WorkerId(e.name): store_worker_id(e.name) for e in config.engines if e.store_events
        }
        self.router: Router = make_router(
            config.policy,
            self.index,
            config.coordinator,
            config.history_blocks,
            stores,
            config.shared_prefix_blocks,
            config.placement,
        )
        self.pool = EnginePool(config.engines, config.health_failures)
        self.decisions = DecisionLog(config.decision_log)
        self.models: list[str] = [config.served_model] if config.served_model else []
        self.verify = verify
        self._client: httpx.AsyncClient | None = None
        self._health: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[object]] = set()

    # ------------------------------------------------------------------ lifecycle

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise KVMeshError("the gateway is not started")
        return self._client

    async def start(self) -> None:
        cfg = self.config
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        for source in self.sources:
            await source.start()
        await self.pool.check_all(self._client, cfg.health_timeout_s)
        await self._learn_models()
        if self.verify is not None:
            self.pool.on_up = self._verify_later
            for engine in self.pool.up():
                self._verify_later(engine)
        self._health = asyncio.create_task(
            self.pool.health_loop(self._client, cfg.health_interval_s, cfg.health_timeout_s)
        )

    async def stop(self) -> None:
        for task in list(self._checks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
            self._health = None
        for source in self.sources:
            await source.stop()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _check_soon(self, engine: EngineState) -> None:
        """A health check of `engine` now, not at the next round."""
        task = asyncio.create_task(
            self.pool.check(self.client, engine, self.config.health_timeout_s)
        )
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    def _verify_later(self, engine: EngineState) -> None:
        """Run `verify` for an engine that is (again) up, without holding up requests.

        A failing check is logged loudly; the check itself takes the engine's
        affinity away (the canary quarantines it), so it still serves, never
        with a wrong cache match.
        """
        if self.verify is None:
            return
        check = self.verify

        async def run() -> None:
            try:
                await check(engine.spec)
                log.info("engine %s passed its hash-parity check", engine.spec.name)
            except KVMeshError as exc:
                log.error("engine %s gets no cache affinity: %s", engine.spec.name, exc)

        task = asyncio.create_task(run())
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _learn_models(self) -> None:
        if self.models:
            return
        for engine in self.pool.up():
            try:
                resp = await self.client.get(
                    engine.spec.base_url + "/v1/models", timeout=self.config.health_timeout_s
                )
                if resp.status_code == 200:
                    self.models = served_models(resp.json())
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("engine %s: /v1/models failed: %s", engine.spec.name, exc)
            if self.models:
                return

    # ------------------------------------------------------------------ routing

    def index_view(self, worker_id: WorkerId) -> dict[str, int]:
        """What the event-fed index holds for an engine (for /health): its blocks and the
        last event batch applied (-1: none yet), so an operator or a benchmark can tell
        a gateway that follows its engines from one still catching up; the same for its
        store (``store_blocks``, ``store_events_seq``) when the gateway follows one."""
        view = self._worker_view(worker_id, "")
        if self.pool.engines[worker_id].spec.store_events:
            view.update(self._worker_view(store_worker_id(worker_id), "store_"))
        return view

    def _worker_view(self, worker_id: WorkerId, prefix: str) -> dict[str, int]:
        if worker_id not in self.index.workers():
            return {prefix + "blocks": 0, prefix + "events_seq": -1}
        state = self.index.worker_state(worker_id)
        return {prefix + "blocks": state.num_pages, prefix + "events_seq": state.last_seq}

    def prompt_hashes(self, prepared: PreparedRequest) -> list[PageHash]:
        """The prompt's full blocks, hashed as the engines hash them."""
        extra = EngineExtraKeys(cache_salt=prepared.cache_salt)
        return self.hasher.hash_prompt(prepared.token_ids, extra)

    def route(
        self,
        prepared: PreparedRequest,
        exclude: set[WorkerId],
        hashes: Sequence[PageHash] | None = None,
    ) -> tuple[EngineState, RouteDecision, int]:
        """The engine for `prepared` among those up and not in `exclude`, the decision and its
        record's id in `decisions`; `NoWorkers` if none.

        `hashes`: `prompt_hashes(prepared)`, when the caller has them already."""
        loads = self.pool.loads(self.router.stale(), exclude)
        if not loads:
            down = {e.spec.name: e.last_error for e in self.pool.engines.values() if not e.up}
            raise NoWorkers(f"no engine can take the request; down: {down or 'none'}")
        if hashes is None:
            hashes = self.prompt_hashes(prepared)
        request = RouteRequest(hashes, len(prepared.token_ids), page_size=self.hasher.block_size)
        key = tie_break_key(hashes, prepared.token_ids)
        overlaps = self.router.overlaps(request, self.pool.prefilling(exclude))
        decision = self.router.choose(request, overlaps, loads, key)
        engine = self.pool[decision.worker_id]
        name = engine.spec.name
        mesh = decision.policy == MESH_POLICY
        stored = decision.promote_pages if mesh else 0
        rid = self.decisions.record(
            policy=self.router.name,
            engine=name,
            prompt_blocks=len(hashes),
            predicted_blocks=decision.local_pages - stored,
            pull_blocks=decision.peer_pages if mesh else 0,
            overlaps=overlaps,
            loads=loads,
            prefix=hashes[0] if hashes else b"",
            attempt=len(exclude),
            store_blocks=stored,
            store_overlaps=overlaps.from_store if isinstance(overlaps, MeshHeld) else None,
        )
        GATEWAY_ROUTED.labels(name, self.router.name).inc()
        GATEWAY_PROMPT_BLOCKS.labels(name).inc(len(hashes))
        GATEWAY_MATCHED_BLOCKS.labels(name).inc(decision.local_pages - stored)
        if mesh:
            GATEWAY_PULL_BLOCKS.labels(name).inc(decision.peer_pages)
            GATEWAY_STORE_BLOCKS.labels(name).inc(stored)
        return engine, decision, rid

    def prediction_headers(self, engine: EngineState, decision: RouteDecision) -> dict[str, str]:
        """What the router predicted for a request, told to its caller: the engine, the
        blocks its cache holds and, under ``kv_mesh``, the blocks it loads from its store
        and those it pulls, and from whom."""
        mesh = decision.policy == MESH_POLICY
        stored = decision.promote_pages if mesh else 0
        headers = {
            ENGINE_HEADER: engine.spec.name,
            MATCHED_HEADER: str(decision.local_pages - stored),
        }
        if mesh:
            headers[STORE_HEADER] = str(stored)
        if mesh and decision.peer_id is not None:
            headers[PULL_HEADER] = str(decision.peer_pages)
            headers[PULL_FROM_HEADER] = self.pool[decision.peer_id].spec.name
        return headers

    def _model_for(self, prepared: PreparedRequest) -> str:
        if prepared.model is None:
            if not self.models:
                raise NoWorkers("no engine has said which model it serves yet; name 'model'")
            return self.models[0]
        if self.models and prepared.model not in self.models:
            raise UnknownModel(
                f"model {prepared.model!r} is not served here; the engines serve {self.models}"
            )
        return prepared.model

    async def forward(self, prepared: PreparedRequest) -> Response:
        """Route and send `prepared`, retrying on the next engine while nothing was answered."""
        if not self.models:
            await self._learn_models()
        model = self._model_for(prepared)
        body = prepared.body_for_engine(model)
        tried: set[WorkerId] = set()
        started = time.perf_counter()
        hashes = self.prompt_hashes(prepared)
        while True:
            engine, decision, rid = self.route(prepared, tried, hashes)
            self.decisions.routed(rid, time.perf_counter() - started)
            reused = decision.local_pages
            if decision.policy == MESH_POLICY:
                reused += decision.peer_pages  # pulled, not computed
            prefill = max(len(prepared.token_ids) - reused * self.hasher.block_size, 0)
            if decision.policy == MESH_POLICY:
                # a pull or a load is engine time too: the same share of a computed block as
                # in the cost
                size, costs = self.hasher.block_size, self.config.coordinator
                prefill += round(decision.peer_pages * size * costs.pull_cost)
                prefill += round(decision.promote_pages * size * costs.host_hit_cost)
            ticket = self.pool.begin(engine, prefill, hashes)
            headers = self.prediction_headers(engine, decision)
            headers[DECISION_HEADER] = str(rid)
            try:
                if prepared.stream:
                    return await self._stream(engine, body, ticket, prepared.chat, headers, rid)
                return await self._answer(engine, body, ticket, prepared.chat, headers, rid)
            except _UNREACHABLE as exc:
                ticket.close()
                reason = type(exc).__name__
                GATEWAY_RETRIES.labels(engine.spec.name, reason).inc()
                self.pool.mark_down(engine, f"request failed: {reason}: {exc}")
                self.router.forget(engine.worker_id)
                tried.add(engine.worker_id)
            except _BROKE_OFF as exc:
                ticket.close()
                GATEWAY_RETRIES.labels(engine.spec.name, type(exc).__name__).inc()
                tried.add(engine.worker_id)
                self._check_soon(engine)
            except httpx.TimeoutException as exc:
                ticket.close()
                raise DeadlineExceeded(
                    f"engine {engine.spec.name} did not answer within "
                    f"{self.config.request_timeout_s:g} s ({type(exc).__name__}); raise "
                    "--request-timeout for longer generations"
                ) from None
            except httpx.HTTPError as exc:
                ticket.close()
                raise TransportError(f"engine {engine.spec.name}: {exc}") from None
            except BaseException:
                ticket.close()
                raise

    async def _answer(
        self,
        engine: EngineState,
        body: dict[str, Any],
        ticket: Ticket,
        chat: bool,
        headers: dict[str, str],
        rid: int,
    ) -> Response:
        t0 = time.perf_counter()
        resp = await self.client.post(engine.spec.base_url + "/v1/completions", json=body)
        self.first_byte(engine, rid, t0)
        ticket.close()
        if resp.status_code == 200:
            try:
                cached = cached_tokens(resp.json().get("usage"))
            except (ValueError, AttributeError):
                cached = None
            self.realize(engine, rid, cached)
        if resp.status_code != 200 or not chat:
            return Response(
                resp.content,
                resp.status_code,
                headers=headers,
                media_type=resp.headers.get("content-type", "application/json"),
            )
        try:
            answer = resp.json()
        except ValueError:
            raise TransportError(f"engine {engine.spec.name} answered with no JSON") from None
        return JSONResponse(chat_from_completion(answer), headers=headers)

    def first_byte(self, engine: EngineState, rid: int, sent_at: float) -> None:
        """The engine's first bytes for decision `rid` came back (`sent_at`: perf_counter)."""
        waited = time.perf_counter() - sent_at
        GATEWAY_FIRST_BYTE.labels(engine.spec.name).observe(waited)
        self.decisions.first_byte(rid, waited)

    def realize(self, engine: EngineState, rid: int, cached: int | None) -> None:
        """The realized side of decision `rid`: the prompt tokens the engine did not compute,
        when it reports them (vLLM's ``--enable-prompt-tokens-details``; None: it did not)."""
        if cached is None:
            return
        blocks = cached // self.hasher.block_size
        GATEWAY_REUSED_BLOCKS.labels(engine.spec.name).inc(blocks)
        self.decisions.realize(rid, blocks)

    async def _stream(
        self,
        engine: EngineState,
        body: dict[str, Any],
        ticket: Ticket,
        chat: bool,
        headers: dict[str, str],
        rid: int,
    ) -> Response:
        t0 = time.perf_counter()
        request = self.client.build_request(
            "POST", engine.spec.base_url + "/v1/completions", json=body
        )
        resp = await self.client.send(request, stream=True)
        if resp.status_code != 200:
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
            ticket.close()
            return Response(
                content,
                resp.status_code,
                headers=headers,
                media_type=resp.headers.get("content-type", "application/json"),
            )
        relay = _relay(
            resp, ticket, chat, engine.spec.name, lambda: self.first_byte(engine, rid, t0)
        )
        if not chat:
            relay = self._watch_usage(relay, engine, rid)
        return _UpstreamStream(relay, resp, ticket, headers)

    async def _watch_usage(
        self, relay: AsyncGenerator[bytes, None], engine: EngineState, rid: int
    ) -> AsyncGenerator[bytes, None]:
        """`relay` unchanged; at its end, the usage chunk's cached tokens realize `rid`.
        Closing this closes `relay` (its engine response and ticket) at once."""
        tail = b""
        try:
            async for chunk in relay:
                tail = (tail + chunk)[-_USAGE_TAIL:]
                yield chunk
        finally:
            await relay.aclose()
        self.realize(engine, rid, usage_in_sse(tail))


_USAGE_TAIL = 4096
"""Bytes of a stream's end kept to read its usage chunk (a few hundred bytes long)."""


class _UpstreamStream(StreamingResponse):
    """A relayed SSE stream that closes its upstream and ticket however the caller leaves.

    Starlette may never start (or may abandon) the body iterator when the
    caller disconnects; closing here stops the engine's work at once.
    """

    def __init__(
        self,
        relay: AsyncIterator[bytes],
        upstream: httpx.Response,
        ticket: Ticket,
        headers: dict[str, str],
    ) -> None:
        super().__init__(relay, media_type="text/event-stream", headers=headers)
        self._upstream = upstream
        self._ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ticket.close()
            await self._upstream.aclose()


async def _relay(
    resp: httpx.Response,
    ticket: Ticket,
    chat: bool,
    name: str,
    first_byte: Callable[[], None],
) -> AsyncGenerator[bytes, None]:
    """The engine's SSE stream, passed through (completions) or reshaped (chat);
    `first_byte` is called when its first bytes arrive."""
    first = True
    try:
        if chat:
            translator = ChatStreamTranslator()
            async for line in resp.aiter_lines():
                if first:
                    first = False
                    ticket.prefill_done()
                    first_byte()
                event = translator.event(line)
                if event is not None:
                    yield event
        else:
            async for chunk in resp.aiter_raw():
                if first:
                    first = False
                    ticket.prefill_done()
                    first_byte()
                yield chunk
    except httpx.HTTPError as exc:
        message = f"engine {name} broke off the stream: {type(exc).__name__}: {exc}"
        log.warning(message)
        yield sse(error_body(message, 502, "upstream_error"))
    finally:
        ticket.close()
        await resp.aclose()


# ---------------------------------------------------------------------- HTTP app


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise MessageTooLarge(f"the request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise MessageTooLarge(f"the request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth is None:
        return None
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise InvalidInput("the Authorization header must be 'Bearer <API key>'")
    return token.strip()


def _error_response(exc: KVMeshError) -> JSONResponse:
    status, kind = http_status(exc)
    return JSONResponse(error_body(str(exc), status, kind), status_code=status)


def create_app(gateway: Gateway) -> FastAPI:
    """The FastAPI app serving `gateway`; its lifespan starts and stops the gateway."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="kvmesh gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway

    @app.exception_handler(KVMeshError)
    async def kvmesh_error(request: Request, exc: KVMeshError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, exc.status_code, kind), status_code=exc.status_code)

    async def handle(request: Request, endpoint: str) -> Response:
        try:
            raw = await _read_body(request, gateway.config.max_body_bytes)
            body = parse_json_body(raw)
            salt = gateway.tenants.resolve_salt(_api_key(request), body.get("cache_salt"))
            prepare = prepare_chat if endpoint == "chat" else prepare_completion
            prepared = prepare(body, gateway.tokenizer, salt)
            resp = await gateway.forward(prepared)
        except KVMeshError as exc:
            resp = _error_response(exc)
        GATEWAY_REQUESTS.labels(endpoint, str(resp.status_code)).inc()
        return resp

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat")

    @app.get("/v1/models")
    async def models() -> Response:
        if not gateway.models:
            await gateway._learn_models()
        if not gateway.models:
            return _error_response(NoWorkers("no engine is up to say which model it serves"))
        data = [{"id": m, "object": "model", "owned_by": "kvmesh"} for m in gateway.models]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        stale = gateway.router.stale()
        engines = {
            e.spec.name: {
                "up": e.up,
                "stale": e.worker_id in stale,
                "inflight": e.inflight_requests,
                "error": e.last_error,
                **gateway.index_view(e.worker_id),
            }
            for e in gateway.pool.engines.values()
        }
        up = any(e.up for e in gateway.pool.engines.values())
        return JSONResponse(
            {"status": "ok" if up else "no engine up", "engines": engines},
            status_code=200 if up else 503,
        )

    @app.get("/kvmesh/decisions")
    async def decisions(since: int = 0) -> Response:
        """The kept routing decisions with id >= `since`, each with its outcome if known."""
        records = gateway.decisions.records(since)
        return JSONResponse({"decisions": [r.as_dict() for r in records]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
