"""Follow real engines' KV events into the global index.

A vLLM engine publishes every change of its prefix cache on a ZMQ PUB socket
(``--kv-events-config``) as frames ``[topic, seq, payload]`` and keeps the
last batches for replay on a ROUTER socket. `EngineSubscriber` follows one
such stream per engine and data-parallel rank and feeds an index (an
`EngineIndex`: the coordinator's `GlobalIndex`, which the gateway hosts),
each rank as its own index worker (`engine_worker_id`: ``engine-0``,
``engine-0@dp1``), with the engine's own block hashes.

What the index holds for an engine is always a subset of what the engine
holds, so cache affinity is never wrong, only sometimes missed:

- **order**: a batch's seq is the frame's; the index applies batches in seq
  order and holds back the ones past a gap (the worker is stale meanwhile,
  so routing gives it no affinity);
- **gaps** are healed from the replay socket: the subscriber asks for every
  batch from the first missing seq on, and the index applies them and the
  held ones in order. Live batches that arrive meanwhile wait in the
  subscriber (`SubscriberConfig.heal_backlog`), not in the index, so a long
  replay cannot overflow the index's reorder window. vLLM pushes a whole
  replay answer through its ROUTER at once and ZMQ drops what passes the
  socket's high-water mark (the end marker with it), so an answer also ends
  after `replay_idle_s` of quiet, and the subscriber asks again from where
  it got to for as long as each answer makes progress;
- **an uncovered gap** (replay answers nothing, cannot keep up with the
  live stream, or the engine has no replay socket) could have hidden
  removals: the engine's entries are dropped and the stream followed afresh
  from its newest batch (when replay no longer has the batch, see below);
- **a bad payload** is counted (``kvmesh_engine_bad_payloads``), logged and
  dropped, never half applied; it is handled as an uncovered gap, since it
  may have carried removals and replaying it would give the same bytes;
- **a restart** shows as a seq lower than one already seen (a new publisher
  counts from 0): a new incarnation replaces the old one's entries, and the
  new life's missed first batches are replayed like any gap. A subscriber
  that joins an engine late replays from seq 0 the same way; when the
  replay buffer no longer reaches back to the gap, the engine's entries are
  dropped and rebuilt from the oldest batch it still has (a store in it is
  held unless a later batch removes it, so the index stays a subset).

A **quarantined** engine (a failed hash-parity canary) has its entries
dropped and stays stale, receiving no affinity, until `release`.

Each rank needs its own stream: vLLM offsets a rank's endpoint ports by its
rank (`EngineEventsEndpoint.streams`). Socket roles mirror vLLM's: its PUB
binds wildcard (``*``, ``::``) and ``ipc://``/``inproc://`` endpoints and
connects to other TCP ones, so the subscriber connects to the former and
binds the latter; the replay ROUTER always binds on the engine's side.

The subscriber runs on an asyncio loop (`start` / `stop`), or on its own
thread with its own loop (`EngineSubscriberThread`). Every index change
happens under `lock`, which a caller reading the index from another thread
takes too.

It lives in the base, beside the engines' event decoding (`engine_events`)
and launcher, because it speaks the engines' protocol, not a component's:
whoever hosts an index of real engines follows them with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import zmq
import zmq.asyncio

from kvmesh.engine_events import SEQ_BYTES, EngineBatch, decode_engine_payload, decode_seq
from kvmesh.engine_launcher import VLLMEngine
from kvmesh.errors import ConfigError, EventDecodeError, InvalidInput, UnknownWorker
from kvmesh.events import ApplyResult, EventBatch
from kvmesh.metrics import (
    ENGINE_BAD_PAYLOADS,
    ENGINE_EVENT_BATCHES,
    ENGINE_EVENT_GAPS,
    ENGINE_RESTARTS,
)
from kvmesh.types import WorkerId

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * SEQ_BYTES
"""Replay's end-of-stream marker (vLLM sends seq -1 as 8 signed bytes)."""

T = TypeVar("T")
AttachMode = Literal["auto", "bind", "connect"]
BatchListener = Callable[[WorkerId, EventBatch], None]


class SeqState(Protocol):
    """The part of an index's view of a worker the subscriber reads: its last applied seq."""

    @property
    def last_seq(self) -> int: ...


class EngineIndex(Protocol):
    """What the subscriber feeds: an index applying event batches per worker in seq order,
    holding back the ones past a gap (`kvmesh.coordinator.index.GlobalIndex` is one)."""

    def register_worker(self, worker_id: WorkerId, incarnation: str | None = None) -> None: ...

    def remove_worker(self, worker_id: WorkerId) -> int: ...

    def workers(self) -> list[WorkerId]: ...

    def worker_state(self, worker_id: WorkerId) -> SeqState: ...

    def is_stale(self, worker_id: WorkerId) -> bool: ...

    def mark_stale(self, worker_id: WorkerId) -> None: ...

    def apply(self, batch: EventBatch) -> ApplyResult: ...


def engine_worker_id(engine_id: str, dp_rank: int | None = 0) -> WorkerId:
    """The index worker id of one data-parallel rank of an engine."""
    return WorkerId(engine_id if not dp_rank else f"{engine_id}@dp{dp_rank}")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint vLLM uses for data-parallel rank `rank` (TCP port + rank, else a suffix)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ConfigError(f"endpoint {endpoint!r} has no port to offset for rank {rank}")
        return endpoint if port == "0" else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def engine_binds(endpoint: str) -> bool:
    """Whether vLLM's PUB socket binds `endpoint` (else it connects, and kvmesh binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True, slots=True)
class EngineStream:
    """One rank's event stream: where to attach, and how."""

    worker_id: WorkerId
    rank: int
    endpoint: str
    replay_endpoint: str | None
    bind: bool


@dataclass(frozen=True, slots=True)
class EngineEventsEndpoint:
    """Where one engine publishes its KV events, as given to its ``--kv-events-config``.

    `endpoint` and `replay_endpoint` are the addresses kvmesh attaches to
    (for an engine binding ``tcp://*:5557``, give its reachable address and
    ``mode="connect"``). `topic` is the engine's ``topic`` (vLLM's default is
    empty); an empty one accepts every topic, like ZMQ's empty subscription.
    `data_parallel_ranks` are the engine's ranks; each publishes on the
    endpoint offset by its rank. `mode` says whether kvmesh binds or
    connects the events endpoint ("auto" mirrors vLLM's rule).
    """

    engine_id: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    data_parallel_ranks: tuple[int, ...] = (0,)
    mode: AttachMode = "auto"

    def __post_init__(self) -> None:
        if not self.engine_id or "@" in self.engine_id:
            raise ConfigError(f"engine id {self.engine_id!r} must be non-empty and without '@'")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                f"events endpoint {self.endpoint!r} must be tcp://, ipc:// or inproc://"
            )
        if not self.data_parallel_ranks or any(r < 0 for r in self.data_parallel_ranks):
            raise ConfigError(f"data_parallel_ranks {self.data_parallel_ranks} must be >= 0")
        if self.mode not in ("auto", "bind", "connect"):
            raise ConfigError(f"mode {self.mode!r} must be auto, bind or connect")
        if self.mode != "connect" and "*" in self.endpoint:
            raise ConfigError(
                f"the engine binds {self.endpoint!r}: give kvmesh its reachable address "
                "(tcp://HOST:PORT) with mode='connect' (kvmesh gateway: --events-connect)"
            )

    @classmethod
    def of_engine(cls, engine: VLLMEngine) -> EngineEventsEndpoint:
        """The endpoint of an engine started by `kvmesh.engine_launcher`."""
        if engine.events_endpoint is None:
            raise ConfigError(f"engine {engine.name} was started without KV events")
        return cls(engine.name, engine.events_endpoint, engine.replay_endpoint, engine.spec.topic)

    def streams(self) -> tuple[EngineStream, ...]:
        bind = self.mode == "bind" or (self.mode == "auto" and not engine_binds(self.endpoint))
        return tuple(
            EngineStream(
                engine_worker_id(self.engine_id, rank),
                rank,
                offset_endpoint(self.endpoint, rank),
                None if self.replay_endpoint is None else offset_endpoint(self.replay_endpoint, rank),
                bind,
            )
            for rank in self.data_parallel_ranks
        )


@dataclass(frozen=True, slots=True)
class SubscriberConfig:
    """`replay_timeout_s`: how long to wait for a replay's first answer before the gap
    counts as uncovered. `replay_idle_s`: the quiet after which an answer that has
    started counts as ended (its tail and end marker were dropped on the way).
    `replay_rounds`: replays in a row without progress tried for one gap.
    `heal_backlog`: live batches kept while a replay runs (the oldest go first;
    the replay brings them again)."""

    replay_timeout_s: float = 5.0
    replay_idle_s: float = 0.5
    replay_rounds: int = 3
    kv_group: int = 0
    receive_hwm: int = 100_000
    heal_backlog: int = 100_000

    def __post_init__(self) -> None:
        if self.replay_timeout_s <= 0 or self.replay_idle_s <= 0:
            raise ConfigError("replay_timeout_s and replay_idle_s must be > 0 seconds")
        if self.replay_rounds < 1 or self.heal_backlog < 1:
            raise ConfigError("replay_rounds and heal_backlog must be >= 1")


@dataclass(frozen=True, slots=True)
class EngineStreamState:
    """What the subscriber knows of one rank's stream (for status pages and tests)."""

    worker_id: WorkerId
    engine_id: str
    incarnation: str | None
    last_seq: int
    """Highest seq received from the current incarnation (-1: none yet)."""
    stale: bool
    healing: bool
    quarantined: str | None
    """Why the engine gets no affinity (a failed canary), or None."""


@dataclass(slots=True)
class _Stream:
    spec: EngineStream
    engine_id: str
    topic: bytes
    socket: zmq.asyncio.Socket | None = None
    incarnation: str | None = None
    last_seq: int = -1
    heal_task: asyncio.Task[None] | None = None
    recv_task: asyncio.Task[None] | None = None
    quarantined: str | None = None
    backlog: deque[EventBatch] = field(default_factory=deque)
    """Live batches received while a replay heals a gap, in seq order."""

    def healing(self) -> bool:
        return self.heal_task is not None and not self.heal_task.done()


class EngineSubscriber:
    """Feeds an `EngineIndex` from engines' KV event streams; see the module docstring.

    `drop_frame(worker_id, seq)` (fault drills and tests) drops a received
    frame as if the network had lost it. Listeners get every decoded batch
    (live or replayed, duplicates included, a quarantined engine's too)
    after the index saw it, or on arrival for a live batch kept aside while a
    replay runs (so a canary is not held up by one); they run on the
    subscriber's loop.
    """

    def __init__(
        self,
        index: EngineIndex,
        engines: Iterable[EngineEventsEndpoint] = (),
        *,
        config: SubscriberConfig | None = None,
        lock: threading.RLock | None = None,
        drop_frame: Callable[[WorkerId, int], bool] | None = None,
    ) -> None:
        self.index = index
        self.config = config or SubscriberConfig()
        self.lock = lock or threading.RLock()
        self._drop_frame = drop_frame
        self._endpoints: dict[str, EngineEventsEndpoint] = {}
        self._streams: dict[WorkerId, _Stream] = {}
        self._listeners: list[BatchListener] = []
        self._ctx: zmq.asyncio.Context | None = None
        for e in engines:
            self._add(e)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Attach to every engine's streams on the running loop; returns once attached."""
        if self._ctx is not None:
            return
        self._ctx = zmq.asyncio.Context()
        for stream in self._streams.values():
            self._open(self._ctx, stream)

    async def stop(self) -> None:
        """Detach from every stream; the index keeps what it holds."""
        tasks = []
        for stream in self._streams.values():
            tasks += self._close(stream)
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> EngineSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def add_engine(self, endpoint: EngineEventsEndpoint) -> None:
        """Follow one more engine (attached at once when the subscriber runs)."""
        for stream in self._add(endpoint):
            if self._ctx is not None:
                self._open(self._ctx, stream)

    async def remove_engine(self, engine_id: str) -> None:
        """Stop following an engine and drop its workers from the index."""
        endpoint = self._endpoints.pop(engine_id, None)
        if endpoint is None:
            raise UnknownWorker(f"engine {engine_id!r} is not followed")
        for spec in endpoint.streams():
            stream = self._streams.pop(spec.worker_id)
            for t in self._close(stream):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            with self.lock:
                self.index.remove_worker(spec.worker_id)

    def _add(self, endpoint: EngineEventsEndpoint) -> list[_Stream]:
        if endpoint.engine_id in self._endpoints:
            raise InvalidInput(f"engine {endpoint.engine_id!r} is already followed")
        specs = endpoint.streams()
        taken = {s.spec.endpoint for s in self._streams.values()}
        for spec in specs:
            if spec.worker_id in self._streams or spec.endpoint in taken:
                raise InvalidInput(f"stream {spec.worker_id} ({spec.endpoint}) is already followed")
        self._endpoints[endpoint.engine_id] = endpoint
        added = [_Stream(spec, endpoint.engine_id, endpoint.topic.encode()) for spec in specs]
        for stream in added:
            self._streams[stream.spec.worker_id] = stream
        return added

    def _open(self, ctx: zmq.asyncio.Context, stream: _Stream) -> None:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.config.receive_hwm)
        sock.setsockopt(zmq.SUBSCRIBE, stream.topic)
        if stream.spec.bind:
            sock.bind(stream.spec.endpoint)
        else:
            sock.connect(stream.spec.endpoint)
        stream.socket = sock
        stream.recv_task = asyncio.get_running_loop().create_task(
            self._receive(stream, sock), name=f"kvmesh-events-{stream.spec.worker_id}"
        )

    def _close(self, stream: _Stream) -> list[asyncio.Task[None]]:
        tasks = [t for t in (stream.recv_task, stream.heal_task) if t is not None]
        for t in tasks:
            t.cancel()
        stream.recv_task = stream.heal_task = None
        if stream.socket is not None:
            stream.socket.close(linger=0)
            stream.socket = None
        return tasks

    # ------------------------------------------------------------------ reading

    def add_listener(self, listener: BatchListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: BatchListener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def engines(self) -> list[str]:
        return sorted(self._endpoints)

    def endpoint(self, engine_id: str) -> EngineEventsEndpoint:
        """Where and how engine `engine_id`'s events are attached; `UnknownWorker` if none."""
        endpoint = self._endpoints.get(engine_id)
        if endpoint is None:
            raise UnknownWorker(f"engine {engine_id!r} is not followed")
        return endpoint

    def worker_ids(self, engine_id: str) -> list[WorkerId]:
        """The index workers of an engine, one per data-parallel rank."""
        return [s.worker_id for s in self.endpoint(engine_id).streams()]

    def stream_state(self, worker_id: WorkerId) -> EngineStreamState:
        stream = self._streams.get(worker_id)
        if stream is None:
            raise UnknownWorker(f"no engine stream feeds worker {worker_id!r}")
        with self.lock:
            stale = self.index.is_stale(worker_id)
        return EngineStreamState(
            worker_id,
            stream.engine_id,
            stream.incarnation,
            stream.last_seq,
            stale or stream.quarantined is not None,
            stream.healing(),
            stream.quarantined,
        )

    def states(self) -> list[EngineStreamState]:
        return [self.stream_state(w) for w in sorted(self._streams)]

    # ------------------------------------------------------------------ quarantine

    def quarantine(self, engine_id: str, reason: str) -> None:
        """Give an engine no affinity: drop its entries and keep it stale until `release`."""
        for wid in self.worker_ids(engine_id):
            stream = self._streams[wid]
            stream.quarantined = reason
            self._resync(stream)
            with self.lock:
                if wid not in self.index.workers():  # nothing heard from it yet
                    self.index.register_worker(wid)
                self.index.mark_stale(wid)
        log.error("engine %s quarantined: %s", engine_id, reason)

    def release(self, engine_id: str) -> None:
        """Trust an engine again from its next batch on (after a passing canary)."""
        for wid in self.worker_ids(engine_id):
            stream = self._streams[wid]
            if stream.quarantined is not None:
                stream.quarantined = None
                self._resync(stream)

    def quarantined(self, engine_id: str) -> str | None:
        reasons = [self._streams[w].quarantined for w in self.worker_ids(engine_id)]
        return next((r for r in reasons if r is not None), None)

    # ------------------------------------------------------------------ frames

    async def _receive(self, stream: _Stream, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                self._on_frames(stream, frames)
            except Exception:  # one stream's bug must not end its subscription
                log.exception("engine stream %s: frame handling failed", stream.spec.worker_id)
                self._bad(stream, "internal")

    def _on_frames(self, stream: _Stream, frames: list[bytes]) -> None:
        wid = stream.spec.worker_id
        if len(frames) != 3:
            self._bad(stream, "frame", f"expected [topic, seq, payload], got {len(frames)} frames")
            return
        topic, seq_frame, payload = frames
        if stream.topic and topic != stream.topic:
            self._bad(stream, "topic", f"topic {topic[:40]!r} is not {stream.topic!r}")
            return
        try:
            seq = decode_seq(seq_frame)
        except EventDecodeError as exc:
            self._bad(stream, "seq", str(exc))
            return
        if self._drop_frame is not None and self._drop_frame(wid, seq):
            return
        incarnation = stream.incarnation
        if incarnation is None or seq <= stream.last_seq:
            incarnation = self._new_incarnation(stream, restarted=incarnation is not None)
        stream.last_seq = seq
        batch = self._decode(stream, incarnation, seq, payload)
        if batch is None:
            self._resync(stream)
            return
        if stream.healing() and stream.quarantined is None:
            self._keep_for_heal(stream, batch)
            return
        result = self._apply(stream, batch)
        if result is ApplyResult.STALE and stream.quarantined is None:
            self._start_healing(stream)

    def _decode(
        self, stream: _Stream, incarnation: str, seq: int, payload: bytes
    ) -> EventBatch | None:
        try:
            decoded: EngineBatch = decode_engine_payload(payload, kv_group=self.config.kv_group)
        except EventDecodeError as exc:
            self._bad(stream, "decode", f"seq {seq}: {exc}")
            return None
        rank = decoded.data_parallel_rank
        if rank is not None and rank != stream.spec.rank:
            self._bad(stream, "dp_rank", f"seq {seq}: rank {rank} on rank {stream.spec.rank}'s stream")
            return None
        return decoded.to_event_batch(stream.spec.worker_id, incarnation, seq)

    def _bad(self, stream: _Stream, reason: str, detail: str = "") -> None:
        ENGINE_BAD_PAYLOADS.labels(stream.spec.worker_id, reason).inc()
        log.warning("engine stream %s: dropped a bad message (%s) %s",
                    stream.spec.worker_id, reason, detail)  # fmt: skip

    def _apply(
        self, stream: _Stream, batch: EventBatch, *, notify: bool = True
    ) -> ApplyResult | None:
        wid = stream.spec.worker_id
        result: ApplyResult | None = None
        if stream.quarantined is not None:
            ENGINE_EVENT_BATCHES.labels(wid, "quarantined").inc()
        else:
            with self.lock:
                result = self.index.apply(batch)
            outcome = "held" if result is ApplyResult.STALE else result.value
            ENGINE_EVENT_BATCHES.labels(wid, outcome).inc()
        if notify:
            self._notify(wid, batch)
        return result

    def _notify(self, wid: WorkerId, batch: EventBatch) -> None:
        for listener in list(self._listeners):
            try:
                listener(wid, batch)
            except Exception:
                log.exception("engine event listener failed on %s seq %d", wid, batch.seq)

    def _new_incarnation(self, stream: _Stream, *, restarted: bool) -> str:
        if stream.heal_task is not None:
            stream.heal_task.cancel()
            stream.heal_task = None
        stream.backlog.clear()
        incarnation = f"{stream.spec.worker_id}/{uuid.uuid4().hex[:12]}"
        stream.incarnation = incarnation
        stream.last_seq = -1
        with self.lock:
            self.index.register_worker(stream.spec.worker_id, stream.incarnation)
            if stream.quarantined is not None:
                self.index.mark_stale(stream.spec.worker_id)
        if restarted:
            ENGINE_RESTARTS.labels(stream.spec.worker_id).inc()
            log.warning("engine stream %s restarted: new incarnation %s",
                        stream.spec.worker_id, incarnation)  # fmt: skip
        return incarnation

    def _resync(self, stream: _Stream, at: int | None = None) -> None:
        """Drop the worker's entries and follow the stream afresh after seq `at`
        (default: its newest batch, and the heal backlog goes too)."""
        if stream.incarnation is None:
            return
        if at is None:
            at = max(stream.last_seq, 0)
            stream.backlog.clear()
        snapshot = EventBatch((), stream.spec.worker_id, stream.incarnation,
                              at, time.time(), True)  # fmt: skip
        with self.lock:
            self.index.apply(snapshot)
            if stream.quarantined is not None:
                self.index.mark_stale(stream.spec.worker_id)

    # ------------------------------------------------------------------ healing

    def _start_healing(self, stream: _Stream) -> None:
        if stream.healing():
            return
        stream.backlog.clear()
        stream.heal_task = asyncio.get_running_loop().create_task(
            self._heal(stream, stream.incarnation or ""), name=f"kvmesh-replay-{stream.spec.worker_id}"
        )

    def _keep_for_heal(self, stream: _Stream, batch: EventBatch) -> None:
        """Hold a live batch until the replay reaches it; past `heal_backlog` of them the
        replay cannot catch up, and the gap counts as uncovered."""
        self._notify(stream.spec.worker_id, batch)
        if len(stream.backlog) < self.config.heal_backlog:
            stream.backlog.append(batch)
            return
        wid = stream.spec.worker_id
        if stream.heal_task is not None:
            stream.heal_task.cancel()
            stream.heal_task = None
        ENGINE_EVENT_GAPS.labels(wid, "uncovered").inc()
        log.warning("engine stream %s: %d live batches arrived while a replay ran; "
                    "dropping its entries and following afresh", wid, len(stream.backlog))  # fmt: skip
        self._resync(stream)

    def _applied_seq(self, stream: _Stream) -> int:
        with self.lock:
            return self.index.worker_state(stream.spec.worker_id).last_seq

    def _feed_backlog(self, stream: _Stream) -> None:
        """Apply the kept live batches that now follow on. At a gap (live frames lost too),
        the index gets the next one to hold back, so it stays stale until the replay
        fills the gap."""
        backlog = stream.backlog
        applied = self._applied_seq(stream)
        while backlog and backlog[0].seq <= applied + 1:
            batch = backlog.popleft()
            if batch.seq == applied + 1:
                self._apply(stream, batch, notify=False)  # listeners had it on arrival
                applied = self._applied_seq(stream)
        if backlog:
            self._apply(stream, backlog.popleft(), notify=False)

    async def _heal(self, stream: _Stream, incarnation: str) -> None:
        wid = stream.spec.worker_id
        start = -1
        fruitless = 0
        rebuilt = False  # counted as uncovered already
        while fruitless < self.config.replay_rounds:
            start = self._applied_seq(stream) + 1
            answered = await self._replay(stream, incarnation, start)
            if stream.incarnation != incarnation or stream.quarantined is not None:
                return  # a restart replaced this life, or a quarantine began, meanwhile
            rebuilt = rebuilt or answered == "rebuilt"
            self._feed_backlog(stream)
            with self.lock:
                stale = self.index.is_stale(wid)
            if not stale:
                if not rebuilt:
                    ENGINE_EVENT_GAPS.labels(wid, "healed").inc()
                return
            if answered == "failed":
                break
            fruitless = 0 if self._applied_seq(stream) >= start else fruitless + 1
        if not rebuilt:
            ENGINE_EVENT_GAPS.labels(wid, "uncovered").inc()
        log.warning("engine stream %s: replay could not cover the gap from seq %d; "
                    "dropping its entries and following afresh", wid, start)  # fmt: skip
        self._resync(stream)

    async def _replay(
        self, stream: _Stream, incarnation: str, start: int
    ) -> Literal["answered", "rebuilt", "failed"]:
        """Apply the engine's buffered batches from `start` on, in order, up to the first
        one missing from the answer or the kept live batches.

        "rebuilt": the buffer began after `start`, so the entries were dropped and
        rebuilt from its oldest batch; "failed": no answer, or a bad one.
        """
        if stream.spec.replay_endpoint is None or self._ctx is None:
            return "failed"
        wid = stream.spec.worker_id
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.config.receive_hwm)
        outcome: Literal["answered", "rebuilt", "failed"] = "failed"
        expected = start
        try:
            sock.connect(stream.spec.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
            wait = self.config.replay_timeout_s
            while True:
                if not await sock.poll(wait * 1000):
                    log.warning("engine stream %s: replay from seq %d %s", wid, start,
                                "timed out" if outcome == "failed" else
                                f"went quiet after seq {expected - 1}")  # fmt: skip
                    return outcome
                frames = await sock.recv_multipart()
                if stream.quarantined is not None:
                    return "failed"  # its batches no longer reach the index
                # vLLM answers [b"", seq, payload] (some versions [b"", topic, seq, payload]).
                if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != SEQ_BYTES:
                    self._bad(stream, "frame", f"replay sent {len(frames)} frames")
                    return "failed"
                seq_frame, payload = frames[-2], frames[-1]
                if seq_frame == END_SEQ:
                    return outcome  # "failed" when the buffer had nothing from `start` on
                if outcome == "failed":
                    outcome, wait = "answered", self.config.replay_idle_s
                seq = int.from_bytes(seq_frame, "big")
                if stream.incarnation != incarnation or seq > stream.last_seq:
                    continue  # a later life's batches, or ones the live stream will bring
                if seq < expected:
                    continue  # applied already
                if seq > expected:
                    if expected != start:
                        return outcome  # one was dropped on the way: ask again from it
                    ENGINE_EVENT_GAPS.labels(wid, "uncovered").inc()
                    log.warning("engine stream %s: the replay buffer begins at seq %d, past "
                                "the gap at %d; rebuilding its entries from there",
                                wid, seq, start)  # fmt: skip
                    self._resync(stream, at=seq - 1)
                    outcome = "rebuilt"
                batch = self._decode(stream, incarnation, seq, payload)
                if batch is None:
                    return "failed"  # the same bad bytes: this gap cannot be healed
                self._apply(stream, batch)
                expected = self._applied_seq(stream) + 1  # held-back batches may follow on
                if stream.backlog and expected >= stream.backlog[0].seq:
                    return outcome  # the kept live batches take it from here
                if expected > stream.last_seq:
                    return outcome
        finally:
            sock.close(linger=0)


class EngineSubscriberThread:
    """An `EngineSubscriber` on its own thread and event loop, for a process without asyncio.

    Read the index under `subscriber.lock`.
    """

    def __init__(self, subscriber: EngineSubscriber) -> None:
        self.subscriber = subscriber
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            return
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.subscriber.start())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.subscriber.stop())
            loop.close()

        self._thread = threading.Thread(target=run, name="kvmesh-engine-events", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise ConfigError(f"the engine event subscriber did not start within {timeout} s")
        if failure:
            self._thread = None
            raise failure[0]

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the subscriber's loop (e.g. the hash-parity canary) and wait for it."""
        if self._loop is None:
            raise ConfigError("the engine event subscriber thread is not running: start() it")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._thread = None
        self._loop = None
