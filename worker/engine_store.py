"""The kvmesh worker beside a real engine: a page store with no model.

A vLLM engine that loads kvmesh's connector (`kvmesh.connector`) saves every
full KV block it computes here and loads from here the blocks it would
otherwise compute. The store is a worker without a model: a `PagePool` and
`KVStore` behind a `PageService`, the gRPC page server (`kvmesh.v1.KVWorker`:
Lookup, FetchPages, PushPages) that the engine and peer stores read from,
and a small control service (`kvmesh.v1.EngineStore`, msgpack bodies):

- ``Save``: sealed blocks with the request's proof (the block digests, their
  tokens and extra keys, the parent digest): every page enters the pool
  through `PageService.insert_many`, proven first, so a page is cached only
  under a hash its tokens produce with the engine's own hash function;
  its ``touched`` digests (blocks the engine loaded from the arena since its
  last save, with no call) are first touched as hits in the pool's LRU;
- ``Forget``: drop blocks the engine refused on load (a seal that failed),
  so the engine's recomputed block is saved in their place;
- ``Describe``: the page size, block size and hash the store was started with;
- ``Prepare``: before the engine loads, make the store hold as much of a
  request's prefix as the mesh has: what is not held is pulled from peer
  stores over the `Peer` contract (`kvmesh.worker.peers`), proven against
  the same kind of book; answers how many leading blocks are held now;
- ``Locate``: where the leading held pages of a load lie in the store's
  shared-memory arena (pool slots), so the engine copies them straight out;
- ``Attach``: lease the arena's staging slots to the calling engine; its
  ``Save`` then names slots it wrote sealed blocks into instead of carrying
  the bytes (a newer lease ends the older one: its saves are refused).

Same host, the page bytes never cross a socket: the pool and a staging area
live in one file under /dev/shm (`kvmesh.page_arena`), which ``Describe``
names and the engine maps; the store unlinks it when it stops. The arena's
directory names the block each pool page holds (written here from the
pool's events, in `_events_out`), so the engine finds its blocks with no
call (``Locate`` remains for clients without it). Neither pins anything: a page evicted and reused while the engine copies it fails the
seal the engine checks on the bytes it copied, and is recomputed. Without an
arena (``--no-shm``, or an engine on another host) pages move over the page
server's ``FetchPages`` and ``Save``'s bytes.

Pages are named by the engine's full 32-byte block digests (the chain needs
whole parents); the engine's KV events name the same blocks by the digests'
low 8 bytes. A page's bytes are opaque to the store: the connector seals
each block (its bytes, its digest and a checksum, `kvmesh.connector.blocks`)
and checks the seal on load, so the store neither knows the engine's layout
nor can hand it bytes that do not belong to the block asked for.

Run one with ``python -m kvmesh.worker.engine_store --page-bytes N
--block-size B`` (`kvmesh.connector.store_launcher` does, for tests and
benchmarks); it prints ``READY <page address> <control address>`` once
both servers listen.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import msgpack
import numpy as np
import torch

from kvmesh.config import TransferConfig
from kvmesh.engine_hash import DEFAULT_ENGINE_SEED, ENGINE_HASH_ALGORITHMS
from kvmesh.errors import (
    ArenaUnavailable,
    ConfigError,
    InvalidInput,
    KVMeshError,
    TransportError,
)
from kvmesh.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored
from kvmesh.grpc_security import ERROR_METADATA_KEY
from kvmesh.hashing import PageHasher
from kvmesh.metrics import ENGINE_STORE_BLOCKS
from kvmesh.page_arena import (
    SHM_DIR,
    Arena,
    ArenaLayout,
    PageDirectory,
    create_arena,
    open_arena,
    sweep_stale,
)
from kvmesh.types import PageHash
from kvmesh.worker import store_events
from kvmesh.worker.kv_store import KVStore, PageBlob
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_proofs import PageProof, ProofBook
from kvmesh.worker.page_service import IncomingPage, PageService, check_hash
from kvmesh.worker.peers import Peers
from kvmesh.worker.transfer_server import ServerThread

log = logging.getLogger(__name__)

CONTROL_SERVICE = "kvmesh.v1.EngineStore"
DIGEST_BYTES = 32
MAX_CONTROL_BYTES = 256 * 1024 * 1024
MAX_BLOCKS_PER_CALL = 65_536
DEFAULT_STAGING_PAGES = 128


class EngineBlockProver(PageHasher):
    """Proves a vLLM block digest from its parent, tokens and extra keys, as the engine hashes.

    A `PageHasher` to `PageService` (its `hash_page` is what proofs recompute),
    but with the engine's chain: ``H((parent or NONE_HASH, tuple(tokens), extra))``
    under the engine's algorithm and seed (`kvmesh.engine_hash`), always the
    full 32-byte digest. A proof's extra keys are ``(None, engine keys)``
    (`engine_proof_extra`): kvmesh reads a proof's first extra key as its own
    LoRA id, which an engine block does not have (the engine's LoRA is in its
    own keys).
    """

    __slots__ = ("_algorithm",)

    def __init__(self, block_size: int, algo: str = "sha256", seed: str | None = None) -> None:
        algorithm = ENGINE_HASH_ALGORITHMS.get(algo)
        if algorithm is None:
            raise ConfigError(
                f"unknown engine hash algorithm {algo!r}; known: {sorted(ENGINE_HASH_ALGORITHMS)}"
            )
        if seed is None and algorithm.needs_seed:
            raise ConfigError(
                f"vLLM seeds {algo!r} with random bytes unless PYTHONHASHSEED is set: give the "
                "store the engine's seed"
            )
        super().__init__(block_size, algo="sha256")
        self._algorithm = algorithm
        self.algo = algo
        self.seed = DEFAULT_ENGINE_SEED if seed is None else seed
        self.root_hash = PageHash(algorithm(self.seed))
        self.digest_size = len(self.root_hash)

    def hash_page(
        self, parent: PageHash | None, tokens: Sequence[int], extra: tuple[Any, ...] | None = None
    ) -> PageHash:
        if len(tokens) != self.page_size:
            raise InvalidInput(f"a block holds exactly {self.page_size} tokens, got {len(tokens)}")
        head = self.root_hash if parent is None else parent
        keys = extra[1] if extra is not None else None
        return PageHash(self._algorithm((bytes(head), tuple(tokens), keys)))


def engine_proof_extra(keys: tuple[Any, ...] | None) -> tuple[Any, ...]:
    """A proof's extra keys for an engine block whose own extra keys are `keys`."""
    return (None, keys)


@dataclass(frozen=True, slots=True)
class BlockRun:
    """Consecutive blocks of one request as the engine describes them: the proof's material.

    `parent` is the digest before the first block (None: the request's first
    block), `tokens` the blocks' tokens (``len(digests) * block_size``),
    `extra` each block's extra keys (LoRA, media, cache_salt) as the engine
    built them.
    """

    parent: PageHash | None
    digests: tuple[PageHash, ...]
    tokens: tuple[int, ...]
    extra: tuple[tuple[Any, ...] | None, ...]

    @classmethod
    def from_wire(cls, body: dict[str, Any], block_size: int) -> BlockRun:
        """A run from a control call's msgpack body; `InvalidInput` says what is wrong."""
        try:
            parent = body.get("parent")
            digests = tuple(check_hash(d, "block digest") for d in body["digests"])
            tokens = tuple(int(t) for t in body["tokens"])
            extra = tuple(body["extra"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"a block run needs parent, digests, tokens, extra: {exc}") from None
        if parent is not None:
            parent = check_hash(parent, "parent digest")
        if len(digests) > MAX_BLOCKS_PER_CALL:
            raise InvalidInput(f"{len(digests)} blocks in one call; at most {MAX_BLOCKS_PER_CALL}")
        if len(tokens) != len(digests) * block_size or len(extra) != len(digests):
            raise InvalidInput(
                f"{len(digests)} blocks of {block_size} tokens need {len(digests) * block_size} "
                f"tokens and {len(digests)} extra keys, got {len(tokens)} and {len(extra)}"
            )
        return cls(parent, digests, tokens, extra)

    def proofs(self, block_size: int) -> ProofBook:
        """The store's book for these blocks, chained from `parent`."""
        book: dict[PageHash, PageProof] = {}
        parent = self.parent
        for i, digest in enumerate(self.digests):
            tokens = self.tokens[i * block_size : (i + 1) * block_size]
            book[digest] = PageProof(parent, tokens, engine_proof_extra(self.extra[i]))
            parent = digest
        return ProofBook(book)


class EngineStore:
    """A page store for one engine: pool, service, page server and control server.

    `page_bytes` is a sealed block's size (a multiple of ``2 * block_size``);
    `peers` are stores `Prepare` pulls from when the caller names none.
    `shm_dir` holds the shared-memory arena (pool and `staging_pages` staging
    slots; None: no arena, gRPC only). `start()` binds both servers (port 0:
    free ports); `stop()` ends them and removes the arena.
    """

    def __init__(
        self,
        *,
        page_bytes: int,
        block_size: int,
        num_pages: int = 256,
        algo: str = "sha256",
        seed: str | None = None,
        peers: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        control_port: int = 0,
        name: str = "engine-store",
        page_delay_s: float = 0.0,
        shm_dir: str | None = SHM_DIR,
        staging_pages: int = DEFAULT_STAGING_PAGES,
    ) -> None:
        if block_size <= 0 or page_bytes <= 0 or page_bytes % (2 * block_size):
            raise ConfigError(
                f"page_bytes {page_bytes} must be a positive multiple of 2 x block_size "
                f"({2 * block_size}); size it with kvmesh.connector.blocks.sealed_page_bytes"
            )
        self.block_size = block_size
        self.page_bytes = page_bytes
        self.page_delay_s = page_delay_s
        self.name = name
        self.peers = tuple(peers)
        prover = EngineBlockProver(block_size, algo, seed)  # refuses a bad hash before any file
        self.pool = PagePool(num_pages, page_size=block_size, event_token_ids=False)
        self.arena: Arena | None = None
        self._staging: np.ndarray | None = None
        memory: torch.Tensor | None = None
        if shm_dir is not None:
            sweep_stale(shm_dir)
            self.arena = create_arena(page_bytes, num_pages, staging_pages, shm_dir)
            memory = torch.frombuffer(self.arena.pages, dtype=torch.uint8)
            self._staging = np.frombuffer(self.arena.staging, dtype=np.uint8).reshape(
                staging_pages, page_bytes
            )
        self._lease: bytes | None = None
        self._lease_lock = threading.Lock()
        self.kv = KVStore(
            num_pages, 1, 1, page_bytes // (2 * block_size), block_size, "uint8", memory=memory
        )
        self.service = PageService(self.pool, self.kv, prover, name=name)
        self.config = TransferConfig(host=host, port=port)
        # page_delay_s: the transfer server's slow-peer test hook (a store killed mid-load)
        self._pages = ServerThread(self.service, self.config, page_delay_s=page_delay_s)
        self._host = host
        self._control_port = control_port
        self._control: grpc.aio.Server | None = None
        self._peer_links = Peers(self.config, worker=name)
        self._peer_arenas: dict[str, Arena] = {}  # control address -> its arena, mapped here
        self._peer_arenas_lock = threading.Lock()
        self.control_address = ""
        # every change of the cached set, in order (kvmesh.worker.store_events publishes them)
        self.on_events: Callable[[list[KVEvent]], object] | None = None
        self._events_lock = threading.Lock()

    @property
    def address(self) -> str:
        """The page server (`kvmesh.v1.KVWorker`) peers and the engine fetch from."""
        return self._pages.address

    def start(self) -> EngineStore:
        self._pages.start()
        try:
            fut = asyncio.run_coroutine_threadsafe(self._start_control(), self._pages.loop)
            self.control_address = fut.result(10)
        except BaseException:
            self._pages.stop()
            raise
        log.info(
            "engine store %s: pages on %s, control on %s",
            self.name,
            self.address,
            self.control_address,
        )
        return self

    def stop(self) -> None:
        if self._control is not None:
            server, self._control = self._control, None
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(server.stop(0.2), self._pages.loop).result(5)
        self._pages.stop()
        self._peer_links.close()
        with self._peer_arenas_lock:
            for arena in self._peer_arenas.values():
                arena.close()
            self._peer_arenas.clear()
        if self.arena is not None:
            self.arena.close()

    def __enter__(self) -> EngineStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ calls

    def save(self, run: BlockRun, pages: Sequence[bytes | memoryview]) -> list[bool]:
        """Prove and cache sealed blocks; per block True new, False already held.

        All or nothing (`PageService.insert_many`): a block whose tokens do not
        hash to its digest, or a page of the wrong size, refuses the call.
        """
        inserted = self._insert(run, pages)
        ENGINE_STORE_BLOCKS.labels(self.name, "saved").inc(sum(inserted))
        return inserted

    def _insert(self, run: BlockRun, pages: Sequence[bytes | memoryview]) -> list[bool]:
        if len(pages) != len(run.digests):
            raise InvalidInput(f"{len(run.digests)} digests but {len(pages)} pages")
        shape = self.kv.page_shape
        incoming = [
            IncomingPage(d, None, (), PageBlob.from_bytes(p, "uint8", shape))
            for d, p in zip(run.digests, pages, strict=True)
        ]
        inserted = self.service.insert_many(incoming, run.proofs(self.block_size))
        self._events_out()
        return inserted

    def attach(self) -> bytes:
        """Lease the staging slots to a new client; the previous lease ends (its saves fail)."""
        if self.arena is None:
            raise ArenaUnavailable(f"store {self.name} has no shared-memory arena (--no-shm)")
        lease = secrets.token_bytes(16)
        with self._lease_lock:
            self._lease = lease
        return lease

    def save_staged(self, run: BlockRun, lease: bytes, slots: Sequence[int]) -> list[bool]:
        """`save` for sealed blocks the lease holder wrote into staging `slots`.

        `ArenaUnavailable` for a lease that is not the current one (another
        client attached since, or this store restarted): its slots may hold
        another client's bytes, so nothing is read.
        """
        staging = self._staging
        if staging is None:
            raise ArenaUnavailable(f"store {self.name} has no shared-memory arena (--no-shm)")
        count = len(staging)
        if len(slots) != len(run.digests) or len(set(slots)) != len(slots):
            raise InvalidInput(f"{len(run.digests)} digests need as many distinct staging slots")
        if not all(isinstance(s, int) and 0 <= s < count for s in slots):
            raise InvalidInput(f"staging slots are integers in [0, {count}), got {list(slots)}")
        with self._lease_lock:
            if lease != self._lease:
                raise ArenaUnavailable(
                    f"store {self.name}'s staging is leased to another client; Attach again"
                )
        return self.save(run, [memoryview(staging[s]) for s in slots])

    def touch(self, digests: Sequence[PageHash]) -> None:
        """Count blocks an engine loaded from the arena (no call then) as hits in the LRU:
        a block loaded often is not the first evicted. Blocks no longer held are passed over."""
        if digests:
            self.service.unpin(self.service.pin(digests))

    def locate(self, digests: Sequence[PageHash]) -> list[int]:
        """Arena slots of the leading `digests` held, touched as a hit; nothing is pinned."""
        ids = self.service.pin(digests)
        self.service.unpin(ids)
        held = ids.index(None) if None in ids else len(ids)
        return [int(pid) for pid in ids[:held] if pid is not None]

    def prepare(
        self, run: BlockRun, peers: Sequence[str] = (), peer_controls: Sequence[str] = ()
    ) -> tuple[int, int, str | None]:
        """Hold as much of `run` as the mesh has: (leading blocks held, blocks pulled, from whom).

        Blocks this store lacks are pulled from `peers` (else the store's own),
        in order, each through a receiver bound to the run's proofs; from a
        peer whose control address `peer_controls` names (same order) and whose
        arena this host maps, they are copied out of its arena instead
        (`_pull_from_arena`). A peer that fails or lacks them is passed over;
        nothing here raises for it.
        """
        held = self.service.prefix_length(run.digests)
        pulled, source = 0, None
        controls = list(peer_controls) if peers else []
        for i, address in enumerate(peers or self.peers):
            if held == len(run.digests):
                break
            control = controls[i] if i < len(controls) else None
            if control is None or not self._pull_from_arena(control, run, held):
                receiver = self.service.receiving(run.proofs(self.block_size))
                outcome = self._peer_links.get(address).pull_into(
                    receiver, run.digests[held:], deadline_s=self.config.deadline_s
                )
                if outcome.error is not None:
                    log.warning("pull from %s for %s failed: %s", address, self.name, outcome.error)
            now = self.service.prefix_length(run.digests)
            if now > held:
                pulled, source, held = pulled + now - held, address, now
        self._events_out()
        ENGINE_STORE_BLOCKS.labels(self.name, "pulled").inc(pulled)
        return held, pulled, source

    def _pull_from_arena(self, control: str, run: BlockRun, held: int) -> bool:
        """Copy the blocks of `run` from `held` on that the peer at `control` holds, out of its
        arena, into this pool (proven like any page: `save`); False when its arena cannot be
        mapped here (another host, no shared memory, down), so the caller pulls over gRPC.

        The peer may evict and reuse a page while it is copied: the page is then cached
        under a digest its bytes do not carry, and the engine that loads it refuses it by
        its seal and recomputes it (as for any page of its own store reused meanwhile).
        """
        if self.page_delay_s:  # the slow-store test hook: a pull that takes a while to start
            time.sleep(self.page_delay_s * (len(run.digests) - held))
        arena = self._peer_arena(control)
        if arena is None:
            return False
        slots = arena.directory.leading(run.digests[held:])
        if not slots:
            return True
        size, block = self.page_bytes, self.block_size
        pages = [bytes(arena.pages[s * size : (s + 1) * size]) for s in slots]
        end = held + len(pages)
        part = BlockRun(
            run.digests[held - 1] if held else run.parent,
            run.digests[held:end],
            run.tokens[held * block : end * block],
            run.extra[held:end],
        )
        try:
            self._insert(part, pages)
        except KVMeshError as exc:
            log.warning("pull from %s's arena for %s refused: %s", control, self.name, exc)
        return True

    def _peer_arena(self, control: str) -> Arena | None:
        """The arena of the peer store at `control`, mapped (and mapped anew once its file is
        gone); None when it offers none this host can map."""
        with self._peer_arenas_lock:
            arena = self._peer_arenas.get(control)
            if arena is not None and not arena.gone():
                return arena
            if arena is not None:
                arena.close()
                del self._peer_arenas[control]
            try:
                layout = self._describe_peer(control)
                if layout is None:
                    return None
                arena = open_arena(layout)
            except KVMeshError as exc:
                log.info("peer %s's arena is not mapped here (%s); pulls over gRPC", control, exc)
                return None
            self._peer_arenas[control] = arena
            return arena

    def _describe_peer(self, control: str) -> ArenaLayout | None:
        """The arena a peer store's ``Describe`` names (None: it has none)."""
        with grpc.insecure_channel(control) as channel:
            describe = channel.unary_unary(f"/{CONTROL_SERVICE}/Describe")
            try:
                raw = describe(msgpack.packb({}), timeout=self.config.deadline_s)
            except grpc.RpcError as exc:
                raise TransportError(
                    f"peer store {control} did not describe itself: {exc}"
                ) from None
        try:
            answer = msgpack.unpackb(raw, raw=False)
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError):
            raise TransportError(f"peer store {control} described itself in no msgpack") from None
        arena = answer.get("arena") if isinstance(answer, dict) else None
        return None if arena is None else ArenaLayout.from_wire(arena)

    def _events_out(self) -> None:
        """Drain the pool's events into the arena's directory and hand them to `on_events`,
        in the order they happened."""
        with self._events_lock:
            events = self.service.take_events()
            if events and self.arena is not None:
                self._index(self.arena.directory, events)
            if events and self.on_events is not None:
                self.on_events(events)

    def _index(self, directory: PageDirectory, events: Sequence[KVEvent]) -> None:
        """Mirror cached pages into the arena's directory (the engine looks blocks up there).

        A page is named after its bytes were written and unnamed when its event
        is drained, just after the bytes of its next block were: an engine that
        reads it in between fails the block's seal and recomputes the block.
        """
        with self.service.lock:
            for event in events:
                if isinstance(event, PagesStored):
                    for digest in event.page_hashes:
                        page = self.pool.get_cached_page(digest)
                        if page is not None:
                            directory.put(page.page_id, digest)
                elif isinstance(event, PagesRemoved):
                    for digest in event.page_hashes:
                        directory.drop(digest)
                elif isinstance(event, AllPagesCleared):
                    directory.clear()

    # ---------------------------------------------------------------- control server

    async def _start_control(self) -> str:
        options = [
            ("grpc.max_receive_message_length", MAX_CONTROL_BYTES),
            ("grpc.max_send_message_length", MAX_CONTROL_BYTES),
        ]
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((self._handlers(),))
        target = f"{self._host}:{self._control_port}"
        port = server.add_insecure_port(target)
        if port == 0:
            raise ConfigError(f"cannot bind the engine store's control server to {target}")
        await server.start()
        self._control = server
        return f"{self._host}:{port}"

    def _handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[[dict[str, Any]], dict[str, Any]]) -> grpc.RpcMethodHandler:
            async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
                try:
                    body = msgpack.unpackb(raw, raw=False, use_list=False, strict_map_key=True)
                    if not isinstance(body, dict):
                        raise InvalidInput("a control call's body is a msgpack map")
                    answer = await asyncio.to_thread(fn, body)
                except KVMeshError as exc:
                    await context.abort(
                        grpc.StatusCode[exc.grpc_code],
                        f"{type(exc).__name__}: {exc}",
                        trailing_metadata=((ERROR_METADATA_KEY, type(exc).__name__),),
                    )
                except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError):
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "InvalidInput: body is not msgpack"
                    )
                return msgpack.packb(answer, use_bin_type=True)

            return grpc.unary_unary_rpc_method_handler(handle)

        return grpc.method_handlers_generic_handler(
            CONTROL_SERVICE,
            {
                "Save": unary(self._save),
                "Prepare": unary(self._prepare),
                "Describe": unary(self._describe),
                "Forget": unary(self._forget),
                "Locate": unary(self._locate),
                "Attach": unary(self._attach),
            },
        )

    def _forget(self, body: dict[str, Any]) -> dict[str, Any]:
        digests = body.get("digests")
        if not isinstance(digests, tuple) or len(digests) > MAX_BLOCKS_PER_CALL:
            raise InvalidInput(f"Forget needs digests: a list of at most {MAX_BLOCKS_PER_CALL}")
        return {"forgotten": self.forget([check_hash(d, "block digest") for d in digests])}

    def forget(self, digests: Sequence[PageHash]) -> int:
        """Drop blocks an engine refused on load (their seal failed), so they can be saved anew.

        A page being read stays readable until released; only its name goes.
        """
        with self.service.lock:
            forgotten = self.pool.evict_pages(digests)
        self._events_out()
        ENGINE_STORE_BLOCKS.labels(self.name, "forgotten").inc(forgotten)
        return forgotten

    def _describe(self, _body: dict[str, Any]) -> dict[str, Any]:
        hasher = self.service.hasher
        return {
            "page_bytes": self.page_bytes,
            "block_size": self.block_size,
            "algo": hasher.algo,
            "root_hash": bytes(hasher.root_hash),
            "arena": None if self.arena is None else self.arena.layout.wire(),
            "peers": list(self.peers),
        }

    def _attach(self, _body: dict[str, Any]) -> dict[str, Any]:
        return {"lease": self.attach()}

    def _locate(self, body: dict[str, Any]) -> dict[str, Any]:
        digests = body.get("digests")
        if not isinstance(digests, tuple) or len(digests) > MAX_BLOCKS_PER_CALL:
            raise InvalidInput(f"Locate needs digests: a list of at most {MAX_BLOCKS_PER_CALL}")
        slots = self.locate([check_hash(d, "block digest") for d in digests])
        if self.page_delay_s:  # the slow-store test hook, as for streamed pages
            time.sleep(self.page_delay_s * len(slots))
        token = None if self.arena is None else self.arena.layout.token
        return {"arena": token, "slots": slots}

    def _save(self, body: dict[str, Any]) -> dict[str, Any]:
        run = BlockRun.from_wire(body, self.block_size)
        touched = body.get("touched") or ()
        if not isinstance(touched, tuple) or len(touched) > MAX_BLOCKS_PER_CALL:
            raise InvalidInput(f"Save's touched is a list of at most {MAX_BLOCKS_PER_CALL} digests")
        self.touch([check_hash(d, "touched block digest") for d in touched])
        if "slots" in body:
            lease, slots = body.get("lease"), body["slots"]
            if not isinstance(lease, bytes) or not isinstance(slots, tuple):
                raise InvalidInput("Save from staging needs lease (bytes) and slots (a list)")
            return {"inserted": self.save_staged(run, lease, slots)}
        pages = body.get("pages")
        if not isinstance(pages, tuple) or not all(isinstance(p, bytes) for p in pages):
            raise InvalidInput("Save needs pages: one bytes value per digest")
        return {"inserted": self.save(run, pages)}

    def _prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        run = BlockRun.from_wire(body, self.block_size)
        peers = body.get("peers") or ()
        controls = body.get("peer_controls") or ()
        if not all(isinstance(p, str) for p in (*peers, *controls)):
            raise InvalidInput("Prepare's peers and peer_controls are host:port strings")
        held, pulled, source = self.prepare(run, peers, controls)
        return {"held": held, "pulled": pulled, "source": source}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvmesh.worker.engine_store", description=__doc__)
    p.add_argument("--page-bytes", type=int, required=True, help="a sealed block's size")
    p.add_argument("--block-size", type=int, required=True, help="the engine's block size")
    p.add_argument("--pages", type=int, default=256, help="pages the store holds")
    p.add_argument("--hash-algo", default="sha256", help="the engine's prefix-caching hash")
    p.add_argument("--seed", default=None, help="the engine's PYTHONHASHSEED, if set")
    p.add_argument("--peer", action="append", default=[], help="a peer store's page address")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--control-port", type=int, default=0)
    p.add_argument("--name", default="engine-store")
    p.add_argument("--page-delay-s", type=float, default=0.0, help="test hook: slow page streams")
    p.add_argument("--shm-dir", default=SHM_DIR, help="where the shared-memory arena lives")
    p.add_argument("--no-shm", action="store_true", help="no arena: pages move over gRPC only")
    p.add_argument(
        "--staging-pages",
        type=int,
        default=DEFAULT_STAGING_PAGES,
        help="arena slots the engine writes its saves into",
    )
    store_events.add_arguments(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a store until SIGTERM / SIGINT; prints READY with both addresses."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    try:
        store = EngineStore(
            page_bytes=args.page_bytes,
            block_size=args.block_size,
            num_pages=args.pages,
            algo=args.hash_algo,
            seed=args.seed,
            peers=args.peer,
            host=args.host,
            port=args.port,
            control_port=args.control_port,
            name=args.name,
            page_delay_s=args.page_delay_s,
            shm_dir=None if args.no_shm else args.shm_dir,
            staging_pages=args.staging_pages,
        )
        publisher = store_events.attach(store, args)
        store.start()
    except KVMeshError as exc:
        print(f"kvmesh: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"READY {store.address} {store.control_address}", flush=True)
    done.wait()
    store.stop()
    if publisher is not None:
        publisher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
