"""kvmesh as a vLLM engine's KV cache: a V1 KV connector over the store beside the engine.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVMeshConnector",
      "kv_connector_module_path": "kvmesh.connector.vllm_connector",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store": "127.0.0.1:P", "control": "127.0.0.1:C"}}'

(`kvmesh.connector.engine_config.connector_config` builds it). ``store`` /
``control`` are the page and control addresses of the engine's store
(`kvmesh.worker.engine_store`); optional ``peers`` (page addresses of other
stores the store may pull from for this engine), ``peer_controls`` (their
control addresses, same order: the engine then reads what they hold from
their arenas' directories), ``directory`` (default true; false: ask the
store by ``Prepare`` and ``Locate`` every time, for comparison), ``timeout_s``,
``prepare_wait_ms`` (how long the scheduler waits for a ``Prepare`` before it
asks again next step), ``async_pulls`` (default true: a claim a peer can
fill is loaded asynchronously, never waited for) and ``shm``
(default true: move blocks through the store's shared-memory arena when it
maps on this host; false: gRPC only).

Scheduler side (one decision per request, before it is scheduled):
`get_num_new_matched_tokens` claims the leading blocks past the engine's own
prefix hit that its store holds; it never claims the prompt's last token.
On one host it reads them from the store's shared-memory directory, with no
call (`kvmesh.connector.directories`). When peer stores hold more of the
prompt (read from their directories: ``peer_controls``), it claims those
blocks too, as an asynchronous load (``(tokens, True)``: vLLM allocates the
blocks and parks the request in ``WAITING_FOR_REMOTE_KVS``, scheduling the
others meanwhile); the worker then asks its store to pull them
(``Prepare``: the store copies them from the peer, proving every page from
the request's tokens), loads them off the step, and reports the request in
`get_finished` (a block it could not load is reported failed there, and
recomputed). When what the peers hold is unknown (peers named by page
address only, another host, a ``--no-shm`` store), or with ``async_pulls``
false, the scheduler asks the store itself: the ask runs on a small thread
pool, an answer within ``prepare_wait_ms`` (default 10) is used at once, a
longer one is "not known yet" (``None``: vLLM skips the request this step
and asks again next step) until it is done; one that fails, or outlasts
``timeout_s``, claims nothing. Each step
`build_connector_meta` lists the blocks to load (claimed ones, with the
engine blocks allocated for them) and the blocks to save (every full block
the step computes, named by the engine's own digests, with the tokens and
extra keys that prove them). Worker side (`kvmesh.connector.block_path`:
shared memory with the store, or gRPC): `start_load_kv` copies the claimed
blocks into the paged KV cache before the forward and checks every seal over
the bytes copied (the block asked for, whole); the first block that fails
and every block after it are reported with `get_block_ids_with_load_errors`,
so vLLM recomputes them (``kv_load_failure_policy: recompute`` is required).
`wait_for_save` copies the step's full blocks out of the KV cache and hands
them to a background saver (`kvmesh.connector.saver`), which seals and saves
them off the step's critical path; a ``kv_producer`` waits for its saves
before it answers (the decode engine loads them next). A store that is down
costs a miss or a skipped save, never a failed request.

Tenants: a request's ``cache_salt`` is in its first block's extra keys, so
its digests, and the names of its pages, differ from every other salt's.

P/D: a ``kv_producer`` engine only saves, a ``kv_consumer`` only loads.

Pinned to vLLM 0.32 (`SUPPORTED_VLLM`): the V1 connector API is marked
experimental and has changed between releases; another version is refused
at start with a clear error.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from kvmesh.connector.block_path import BlockPath, KVLayers, Loaded, PendingSave
from kvmesh.connector.blocks import BlockRun, block_run
from kvmesh.connector.directories import StoreDirectories
from kvmesh.connector.engine_config import SUPPORTED_VLLM, check_vllm_version, prepare_wait_s
from kvmesh.connector.hook_timings import HookTimer, write_timings_if_asked
from kvmesh.connector.saver import BackgroundSaver
from kvmesh.connector.store_client import Prepared, StoreClient
from kvmesh.errors import ConfigError, KVMeshError, TransportError
from kvmesh.metrics import CONNECTOR_BLOCKS, CONNECTOR_PREPARE_ANSWERS, MetricChild

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

WARN_EVERY_S = 30.0
PREPARE_THREADS = 4  # concurrent Prepare calls of one engine (pulls of different requests)
PULL_THREADS = 2  # asynchronous loads under way at once in the worker (pull, then copy)
DESCRIBE_TIMEOUT_S = 0.5  # the scheduler maps a store's directory (rarely: once, and on restarts)


@dataclass(slots=True)
class BlockLoad:
    """Pages to load into engine blocks, in prefix order; with `pull`, asynchronously, after
    the store pulled the blocks it lacks from its peers (`pull`: their proof)."""

    request_id: str
    block_ids: list[int]
    digests: list[bytes]
    pull: BlockRun | None = None


@dataclass(frozen=True, slots=True)
class _Claim:
    """Blocks claimed past the engine's own hit; `pull`: peers hold some (loaded async)."""

    first: int
    blocks: int
    pull: bool = False
    from_peers: bool = False  # some in peers' arenas, copied from there in the step


@dataclass(slots=True)
class BlockSave:
    """Engine blocks one step computed, to seal and save with their proof."""

    request_id: str
    block_ids: list[int]
    run: BlockRun


@dataclass
class KVMeshConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves, from the scheduler side to the worker side."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)


@dataclass(slots=True)
class _Asking:
    """A `Prepare` under way for one request: from which block, since when."""

    first: int
    last: int
    started: float
    answer: Future[Prepared]


class _Warnings:
    """Logs a repeated failure at most once per `WARN_EVERY_S` (a dead store is not a flood)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def warn(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last.get(what, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._last[what] = now
            log.warning("kvmesh connector: %s failed (%s: %s)", what, type(exc).__name__, exc)


class KVMeshConnector(KVConnectorBase_V1):
    """vLLM's KV connector over a kvmesh engine store (module docstring: the protocol)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ConfigError(
                "kvmesh's connector needs kv_load_failure_policy 'recompute' in "
                "--kv-transfer-config: a block that fails its check is recomputed, and with "
                f"{transfer.kv_load_failure_policy!r} vLLM would fail the request instead"
            )
        extra = transfer.kv_connector_extra_config or {}
        self.block_size: int = vllm_config.cache_config.block_size
        self.hash_algo: str = vllm_config.cache_config.prefix_caching_hash_algo
        self.saves = transfer.is_kv_producer
        self.loads = transfer.is_kv_consumer
        self.peers: list[str] = list(extra.get("peers") or ())
        self.peer_controls: list[str] = list(extra.get("peer_controls") or ())
        if self.peer_controls and len(self.peer_controls) != len(self.peers):
            raise ConfigError(
                f"kv_connector_extra_config names {len(self.peers)} peers but "
                f"{len(self.peer_controls)} peer_controls; give each peer store's control "
                "address in the order of peers (or none)"
            )
        self.client = StoreClient(
            str(extra.get("store") or ""),
            str(extra.get("control") or ""),
            float(extra.get("timeout_s", 5.0)),
        )
        self.shm = bool(extra.get("shm", True))
        # False: every claim asks the store (Prepare) and every load asks where pages lie
        # (Locate), as before the directory (benchmarks/connector_overhead.py compares both)
        self.directory = bool(extra.get("directory", True))
        self.prepare_wait_s = prepare_wait_s(extra.get("prepare_wait_ms"))
        # a claim peers can fill: copied straight out of their arenas in the step, like the
        # store's own blocks (False: the store pulls them first, async_pulls says how)
        self.direct_pulls = bool(extra.get("direct_pulls", True))
        # a pull by the store: loaded asynchronously (False: the scheduler asks, Prepare)
        self.async_pulls = bool(extra.get("async_pulls", True))
        self._warnings = _Warnings()
        self._timer = HookTimer(self.client.page_address)
        write_timings_if_asked("scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        # scheduler side
        self._asking: dict[str, _Asking] = {}
        self._directories: StoreDirectories | None = None
        self._prepares: ThreadPoolExecutor | None = None
        self._requests: dict[str, Request] = {}
        self._matched: dict[str, _Claim] = {}
        self._loads: list[BlockLoad] = []
        # worker side
        self._path: BlockPath | None = None
        self.block_nbytes = 0
        self.page_bytes = 0
        self._failed: set[int] = set()
        self._failed_requests: set[str] = set()  # this step: their computed KV is not saved
        self._saver: BackgroundSaver | None = None
        self._pulls: ThreadPoolExecutor | None = None
        self._pulling: dict[str, tuple[BlockLoad, Future[Loaded]]] = {}

    # ================================================================ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        with self._timer.timed("get_num_new_matched_tokens"):
            tokens = self._matched_tokens(request, num_computed_tokens)
        claim = self._matched.get(request.request_id)
        pulls = bool(tokens) and claim is not None and claim.pull
        return tokens, pulls

    def _answered(self, answer: str) -> None:
        CONNECTOR_PREPARE_ANSWERS.labels(self.client.page_address, answer).inc()

    def _matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens past the engine's own hit the store holds; None: not known yet (pending)."""
        self._requests[request.request_id] = request
        if not self.loads:
            return 0
        size = self.block_size
        first = num_computed_tokens // size
        # never the last token: the engine computes at least one to sample from
        last = min(len(request.block_hashes), (request.num_tokens - 1) // size)
        if last <= first:
            self._answered("direct")
            return 0
        asking = self._asking.get(request.request_id)
        if asking is None:
            read = self._held_without_asking(request, first, last)
            if read is not None:
                self._answered("async" if read.pull else "peers" if read.from_peers else "read")
                self._matched[request.request_id] = read
                return read.blocks * size
        fresh = asking is None
        if asking is None:
            asking = self._ask(request, first, last)
            wait([asking.answer], timeout=self.prepare_wait_s)  # the common, local case
        if not asking.answer.done():
            if time.monotonic() - asking.started < self.client.timeout_s:
                self._answered("pending")
                return None  # vLLM skips the request this step and asks again
            self._asking.pop(request.request_id, None)
            self._answered("timed_out")
            self._warnings.warn("prepare", TransportError("no answer within timeout_s"))
            return 0
        self._asking.pop(request.request_id, None)
        held = self._held(asking, first, last)
        if asking.answer.exception() is not None:
            self._answered("failed")
        else:
            self._answered("in_time" if fresh else "late")
        self._matched[request.request_id] = _Claim(first, held)
        return held * size

    def _held_without_asking(self, request: Request, first: int, last: int) -> _Claim | None:
        """The claim from `first` read from the stores' directories: what the store holds,
        and what its peers hold after that (a pull, loaded asynchronously); None: what the
        peers hold is unknown (or ``async_pulls`` is off), ask the store (`Prepare`)."""
        if not (self.shm and self.directory):
            return None
        if self._directories is None:
            # their own clients, with a short deadline: the scheduler waits for a Describe
            wait = min(self.client.timeout_s, DESCRIBE_TIMEOUT_S)
            own = StoreClient(self.client.page_address, self.client.control_address, wait)
            peers = [  # peer_controls are all the peers' or none (checked at start)
                StoreClient(page, control, wait)
                for page, control in zip(self.peers, self.peer_controls, strict=False)
            ]
            self._directories = StoreDirectories(own, peers)
        directories = self._directories
        digests = [bytes(h) for h in request.block_hashes[first:last]]
        held = directories.held(digests)
        if held is None:
            return None
        if held == len(digests) or not directories.pulls_possible(self.peers):
            return _Claim(first, held)
        more = directories.peers_leading(digests[held:])
        if more == 0:
            return _Claim(first, held)
        if more is None:
            return None
        if self.direct_pulls:  # the worker copies them out of the peers' arenas
            return _Claim(first, held + more, from_peers=True)
        if not self.async_pulls:
            return None
        return _Claim(first, held + more, pull=True)

    def _ask(self, request: Request, first: int, last: int) -> _Asking:
        """Start the store's `Prepare` of blocks [first, last) on the pool (off the step)."""
        if self._prepares is None:
            self._prepares = ThreadPoolExecutor(PREPARE_THREADS, "kvmesh-prepare")
        run = self._run(request, first, last)  # read here: the scheduler owns the request
        answer = self._prepares.submit(self._prepare, run)
        asking = _Asking(first, last, time.monotonic(), answer)
        self._asking[request.request_id] = asking
        return asking

    def _prepare(self, run: BlockRun) -> Prepared:
        """The store's `Prepare` (on the pool's thread), timed: how long a request may wait."""
        with self._timer.timed("prepare"):
            return self.client.prepare(run, self.peers, self.peer_controls)

    def _held(self, asking: _Asking, first: int, last: int) -> int:
        """Blocks from `first` the store holds, by a finished `Prepare` (0 if it failed).

        The engine's own hit may have grown since the ask (another request
        computed the prefix meanwhile): the store's run still covers [first, end).
        """
        try:
            held = asking.answer.result().held
        except KVMeshError as exc:
            self._warnings.warn("prepare", exc)
            return 0
        end = asking.first + max(0, min(held, asking.last - asking.first))
        if first < asking.first:
            return 0  # the engine lost part of its hit: the store was not asked for it
        return max(0, min(end, last) - first)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        claim = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or claim is None:
            return
        first = claim.first
        count = min(claim.blocks, num_external_tokens // self.block_size)
        block_ids = blocks.get_block_ids()[0][first : first + count]
        digests = [bytes(h) for h in request.block_hashes[first : first + count]]
        pull = self._run(request, first, first + count) if claim.pull else None
        self._loads.append(BlockLoad(request.request_id, list(block_ids), digests, pull))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        with self._timer.timed("build_connector_meta"):
            return self._step_meta(scheduler_output)

    def _step_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (claimed blocks) and saves (every full block it computes)."""
        meta = KVMeshConnectorMetadata(loads=self._loads)
        self._loads = []
        if not self.saves or self._kv_cache_manager is None:
            return meta
        size = self.block_size
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(request_id)
            if request is None or scheduled <= 0:
                continue
            before = request.num_computed_tokens  # not yet advanced for this step
            first = before // size
            last = min(len(request.block_hashes), (before + scheduled) // size)
            if last <= first:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(request_id)[0]
            run = self._run(request, first, last)
            meta.saves.append(BlockSave(request_id, list(block_ids[first:last]), run))
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        asking = self._asking.pop(request.request_id, None)
        if asking is not None:
            asking.answer.cancel()  # a Prepare under way finishes; the store keeps its pages
        return False, None

    def _run(self, request: Request, first: int, last: int) -> BlockRun:
        """Blocks [first, last) of `request` with the tokens and extra keys that prove them."""
        size = self.block_size
        extra = []
        mm_index = 0
        for i in range(last):
            keys, mm_index = generate_block_hash_extra_keys(
                request, i * size, (i + 1) * size, mm_index
            )
            extra.append(keys)
        digests = [bytes(h) for h in request.block_hashes[:last]]
        tokens = list(request.all_token_ids[: last * size])
        return block_run(digests, tokens, extra, first, last, size)

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep every layer's paged KV tensor, blocks along dim 0, and size the sealed page."""
        num_blocks = self._kv_cache_config.num_blocks
        layers = list(kv_caches.values())
        for name, tensor in kv_caches.items():
            if tensor.shape[0] != num_blocks or tensor.shape[2] != self.block_size:
                raise ConfigError(
                    f"layer {name}'s KV cache is {list(tensor.shape)}; kvmesh's connector reads "
                    f"[blocks={num_blocks}, heads, block_size={self.block_size}, ...] (vLLM "
                    f"{SUPPORTED_VLLM}x's standard per-layer view)"
                )
        peers = [  # stores whose arenas the worker loads pulls from (peer_controls named)
            StoreClient(page, control, self.client.timeout_s)
            for page, control in zip(self.peers, self.peer_controls, strict=False)
        ]
        path = BlockPath(
            self.client,
            KVLayers(layers),
            self.block_size,
            shm=self.shm,
            directory=self.directory,
            peers=peers if self.direct_pulls and self.directory else (),
        )
        self._path = path
        self.block_nbytes = path.block_nbytes
        self.page_bytes = path.page_bytes
        self._check_store(path)
        if self.saves:
            timer = self._timer

            def send(pending: PendingSave) -> list[bool]:
                with timer.timed("send"):  # the saver thread's share of the worker's core
                    return path.send(pending)

            self._saver = BackgroundSaver(
                send,
                release=path.release,
                store=self.client.page_address,
                on_error=lambda exc: self._warnings.warn("save", exc),
            )

    def _check_store(self, path: BlockPath) -> None:
        """Refuse a store whose page size or hash does not match this engine (if it answers);
        map its shared-memory arena when it offers one."""
        try:
            info = path.connect()
        except KVMeshError as exc:
            self._warnings.warn("describe (store not up yet?)", exc)
            return
        wrong = []
        if info.page_bytes != self.page_bytes:
            wrong.append(f"page_bytes {info.page_bytes} != {self.page_bytes}")
        if info.block_size != self.block_size:
            wrong.append(f"block_size {info.block_size} != {self.block_size}")
        if info.algo != self.hash_algo:
            wrong.append(f"hash algo {info.algo!r} != {self.hash_algo!r}")
        none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
        if none_hash is not None and bytes(none_hash) != info.root_hash:
            wrong.append("root hash differs (PYTHONHASHSEED of engine and store)")
        if wrong:
            raise ConfigError(
                f"the engine store at {self.client.control_address} does not fit this engine: "
                f"{'; '.join(wrong)}; start it with the engine's block size, hash algorithm, "
                "seed and page bytes (kvmesh.connector.store_launcher)"
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        with self._timer.timed("start_load_kv"):
            self._load_all()

    def _load_all(self) -> None:
        """Load every block this step claimed; failed ones are reported for recompute."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVMeshConnectorMetadata)
        self._failed_requests = set()
        for load in meta.loads:
            if load.pull is not None:
                self._start_pull(load)
                continue
            if self._counted(load, self._load(load)) < len(load.block_ids):
                self._failed_requests.add(load.request_id)

    def _load(self, load: BlockLoad) -> Loaded:
        """Copy and check `load`'s blocks in order (nothing loaded without a data path)."""
        if self._path is None:
            return Loaded(0)
        return self._path.load(load.digests, load.block_ids)

    def _start_pull(self, load: BlockLoad) -> None:
        """Start an asynchronous load: the store pulls, then the blocks are copied, off the
        step; `get_finished` reports it."""
        if self._pulls is None:
            self._pulls = ThreadPoolExecutor(PULL_THREADS, "kvmesh-pull")
        self._pulling[load.request_id] = (load, self._pulls.submit(self._pull, load))

    def _pull(self, load: BlockLoad) -> Loaded:
        """Ask the store to pull the blocks it lacks (a failure leaves what it holds), then
        load what it holds (on the pull pool's thread)."""
        assert load.pull is not None
        with self._timer.timed("pull"):
            try:
                self.client.prepare(load.pull, self.peers, self.peer_controls)
            except KVMeshError as exc:
                self._warnings.warn("prepare", exc)
            return self._load(load)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Asynchronous loads done since the last step (their failed blocks are reported by
        `get_block_ids_with_load_errors` in the same pass, as vLLM asks)."""
        done = {rid for rid, (_, answer) in self._pulling.items() if answer.done()}
        for request_id in done:
            load, answer = self._pulling.pop(request_id)
            try:
                loaded = answer.result()
            except Exception as exc:  # a bug in the pull must not leave the request waiting
                log.exception("kvmesh connector: an asynchronous load failed")
                loaded = Loaded(0, error=KVMeshError(str(exc)))
            self._counted(load, loaded)
        return None, done or None

    def _counted(self, load: BlockLoad, loaded: Loaded) -> int:
        """Count how `load` went and mark the blocks it did not load for recompute; how many
        leading blocks loaded."""
        missed = len(load.block_ids) - loaded.blocks
        if loaded.refused is not None:
            what = f"check of block {loaded.refused.hex()[:16]}"
            self._warnings.warn(what, loaded.error or KVMeshError("its seal failed"))
            self._blocks("refused").inc()
            missed -= 1
            self._forget(loaded.refused)
        elif loaded.error is not None:
            self._warnings.warn("load", loaded.error)
        self._blocks("undelivered").inc(missed)
        self._blocks("loaded").inc(loaded.blocks)
        self._failed.update(load.block_ids[loaded.blocks :])
        return loaded.blocks

    def _blocks(self, outcome: str) -> MetricChild:
        return CONNECTOR_BLOCKS.labels(self.client.page_address, outcome)

    def _forget(self, digest: bytes) -> None:
        """Drop a refused block from the store, so this engine's recomputed one is saved."""
        try:
            self.client.forget([digest])
        except KVMeshError as exc:
            self._warnings.warn("forget", exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load completed in start_load_kv, before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # blocks are saved whole, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        with self._timer.timed("wait_for_save"):
            self._stage_all()

    def _stage_all(self) -> None:
        """Stage the step's computed blocks for the saver (a producer waits for them)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVMeshConnectorMetadata)
        saver, path = self._saver, self._path
        if saver is None or path is None:
            return
        for save in meta.saves:
            if save.request_id in self._failed_requests:
                continue  # this step attended over blocks that failed to load: not saved
            pending = path.stage(save.run, save.block_ids)
            if pending is None:
                self._blocks("dropped").inc(len(save.block_ids))
                self._warnings.warn("save", TransportError("no free staging slot; save dropped"))
            elif not saver.submit(pending):
                self._warnings.warn("save", TransportError("the store is behind; save dropped"))
        if not self.loads:
            # a prefill engine's hand-off: its blocks are in the store before it answers
            saver.flush(self.client.timeout_s)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        if self._directories is not None:
            self._directories.close()
        if self._prepares is not None:
            self._prepares.shutdown(wait=False, cancel_futures=True)
        if self._pulls is not None:
            self._pulls.shutdown(wait=False, cancel_futures=True)
        if self._saver is not None:
            self._saver.close()
        if self._path is not None:
            self._path.close()
        self.client.close()
