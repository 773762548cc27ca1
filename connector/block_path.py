"""The engine's KV blocks to and from its store: shared memory on one host, gRPC otherwise.

`BlockPath` is the connector's data path, apart from vLLM (the benchmark
drives it with plain tensors). On `connect` it asks the store for its arena
(``Describe``, `kvmesh.page_arena`) and maps it; a store that offers none, or
one this host cannot map (another host, another container), is reached over
gRPC, counted in ``kvmesh_connector_shm_unmapped``.

Load, shared memory, with no call to the store: the arena's directory
(`kvmesh.page_arena.PageDirectory`) names the pages of the leading blocks the
store holds; each block is copied straight from the mapping into the KV
cache (one copy per layer), then its seal is checked over the bytes now in
the KV cache (`check_seal`), with the seal read from the arena. Nothing is
pinned in the store: a page evicted and reused while it was copied (or a
directory entry a moment stale) fails the check, and it and every later
block are recomputed. An arena whose file is gone (the store restarted) is
mapped anew first. gRPC: ``FetchPages``, then `unseal` and the same copy.

Peers (`peers`: their control clients, on one host): a load that runs past
what the engine's store holds goes on in the peer stores' arenas, each
mapped here once (``Describe``), in order: the directory names the pages,
they are copied into the KV cache and checked by their seals exactly as the
store's own, with no call to either store (a pull that costs a copy, not a
``Prepare``). A peer that cannot be mapped is passed over (the blocks are
recomputed) and described again after `PEER_RETRY_S`.

A load read from the directory makes no call, so the store does not see it
as a hit: its blocks are remembered (`MAX_TOUCHED`) and sent with the next
save, which the store touches first (a block loaded often is not the first
evicted).

Save: `stage` runs in the engine's step and copies the step's blocks out of
the KV cache (the engine may reuse them once the request ends): into staging
slots of the arena leased to this engine (``Attach``), or into bytes for
gRPC. `send` runs on the saver thread: it seals the staged blocks in place
and names their slots in ``Save`` (or sends the bytes). Slots come back when
the save is done; a step that finds too few free is dropped, like a save
the store is too far behind to take.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.connector.blocks import (
    SEAL_BYTES,
    BlockRun,
    check_seal,
    seal,
    seal_into,
    sealed_page_bytes,
    unseal,
)
from kvmesh.connector.store_client import StoreClient, StoreInfo
from kvmesh.errors import ArenaUnavailable, ConfigError, KVMeshError, TransportError
from kvmesh.metrics import CONNECTOR_SHM_UNMAPPED
from kvmesh.page_arena import Arena, open_arena

log = logging.getLogger(__name__)

MAX_TOUCHED = 4096  # loaded blocks remembered for the store's LRU until the next save
PEER_RETRY_S = 5.0  # a peer store whose arena could not be mapped is described again this late


class KVLayers:
    """An engine's paged KV cache as the store sees a block: every layer's slab, in order.

    Each tensor holds blocks along dim 0; a block's bytes are layer 0's
    ``t[block]`` then layer 1's..., in each slab's logical order.
    """

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        if not layers:
            raise ConfigError("the engine registered no KV cache layers")
        self.layers = list(layers)
        self.sizes = [t[0].numel() * t.element_size() for t in self.layers]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.block_nbytes = sum(self.sizes)
        self._views = [(t, o, n, t.dtype, t.shape[1:]) for t, o, n in zip(
            self.layers, self.offsets, self.sizes, strict=True)]  # fmt: skip

    def write(self, block_id: int, row: torch.Tensor) -> None:
        """Copy a block's bytes (`row`, uint8, at least `block_nbytes`) into every layer."""
        for t, o, n, dtype, shape in self._views:
            t[block_id].copy_(row[o : o + n].view(dtype).view(shape))

    def read_into(self, block_id: int, row: torch.Tensor) -> None:
        """Copy a block's bytes out of every layer into `row` (uint8, writable)."""
        for t, o, n, dtype, shape in self._views:
            row[o : o + n].view(dtype).view(shape).copy_(t[block_id])

    def block_bytes(self, block_id: int) -> bytes:
        """A block's bytes as one owned copy (the gRPC path)."""
        out = torch.empty(self.block_nbytes, dtype=torch.uint8)
        self.read_into(block_id, out)
        return out.numpy().tobytes()

    def parts(self, block_id: int) -> list[memoryview]:
        """The block's bytes where they lie in the KV cache (no copy for contiguous slabs)."""
        return [t[block_id].reshape(-1).view(torch.uint8).numpy().data for t in self.layers]


class _Slots:
    """Free staging slots of one lease; taken by the step, given back by the saver thread."""

    def __init__(self, count: int) -> None:
        self._free = deque(range(count))
        self._lock = threading.Lock()

    def take(self, n: int) -> tuple[int, ...] | None:
        with self._lock:
            if n > len(self._free):
                return None
            return tuple(self._free.popleft() for _ in range(n))

    def give(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)


class Mapped:
    """One store arena, mapped here: its pool (read-only) and the staging leased to us."""

    def __init__(self, arena: Arena) -> None:
        layout = arena.layout
        self.arena = arena
        self.token = layout.token
        with warnings.catch_warnings():  # the pool is mapped read-only, on purpose
            warnings.simplefilter("ignore", UserWarning)
            pages = torch.frombuffer(arena.pages, dtype=torch.uint8)
        self.pages = pages.view(layout.pages, layout.page_bytes)
        self.pages_np = np.frombuffer(arena.pages, dtype=np.uint8).reshape(
            layout.pages, layout.page_bytes
        )
        self.staging = torch.frombuffer(arena.staging, dtype=torch.uint8).view(
            layout.staging, layout.page_bytes
        )
        self.staging_np = np.frombuffer(arena.staging, dtype=np.uint8).reshape(
            layout.staging, layout.page_bytes
        )
        self.lease: bytes | None = None
        self.slots = _Slots(layout.staging)


@dataclass(frozen=True, slots=True)
class PendingSave:
    """One request's blocks of one step, copied out of the KV cache, waiting to be saved.

    Either `blocks` (their bytes, for gRPC) or `slots` of `staged` (the
    arena mapping they were copied into, with its lease).
    """

    run: BlockRun
    blocks: tuple[bytes, ...] = ()
    slots: tuple[int, ...] = ()
    staged: Mapped | None = None


@dataclass(frozen=True, slots=True)
class Loaded:
    """How a load went: leading blocks copied and checked; the block refused (its seal
    failed) or the store's failure, with its error, if either stopped it."""

    blocks: int
    refused: bytes | None = None
    error: KVMeshError | None = None


class BlockPath:
    """Loads and saves one engine's blocks through its store (module docstring: how)."""

    def __init__(
        self,
        client: StoreClient,
        layers: KVLayers,
        block_size: int,
        *,
        shm: bool = True,
        directory: bool = True,
        peers: Sequence[StoreClient] = (),
    ) -> None:
        self.client = client
        self.peers = list(peers)  # other stores on this host, loaded from in order
        self._peer_maps: list[Mapped | None] = [None] * len(self.peers)
        self._peer_retry = [0.0] * len(self.peers)
        self.layers = layers
        self.block_nbytes = layers.block_nbytes
        self.page_bytes = sealed_page_bytes(layers.block_nbytes, block_size)
        self.shm = shm
        self.directory = directory  # False: ask the store where pages lie (Locate), as before
        self._mapped: Mapped | None = None
        self._arena_seen = False  # the store offered an arena this host mapped: Locate first
        self._lock = threading.Lock()
        # blocks loaded through the directory since the last save: touched by the next one
        self._touched: deque[bytes] = deque(maxlen=MAX_TOUCHED)

    @property
    def mapped(self) -> Mapped | None:
        """The arena in use (None: gRPC)."""
        return self._mapped

    def connect(self) -> StoreInfo:
        """Describe the store and map its arena when it offers one this host can map."""
        info = self.client.describe()
        with self._lock:
            self._map(info)
        return info

    def _map(self, info: StoreInfo) -> None:
        old, self._mapped = self._mapped, None
        if old is not None:
            old.arena.close()
        if not self.shm:
            return
        store = self.client.page_address
        if info.arena is None:
            CONNECTOR_SHM_UNMAPPED.labels(store, "not_offered").inc()
            log.info("kvmesh connector: store %s offers no shared memory; gRPC", store)
            return
        try:
            self._mapped = Mapped(open_arena(info.arena))
            self._arena_seen = True
        except ArenaUnavailable as exc:
            CONNECTOR_SHM_UNMAPPED.labels(store, "unmappable").inc()
            log.warning("kvmesh connector: %s; blocks move over gRPC", exc)

    def current(self) -> Mapped | None:
        """The store's arena, mapped anew if the one mapped is gone (the store restarted);
        None: gRPC. `KVMeshError` when the store cannot be described."""
        with self._lock:
            mapped = self._mapped
            if mapped is not None and not mapped.arena.gone():
                return mapped
            self._map(self.client.describe())
            return self._mapped

    # ------------------------------------------------------------------ load

    def load(self, digests: Sequence[bytes], block_ids: Sequence[int]) -> Loaded:
        """Copy the stored blocks `digests` into engine blocks `block_ids`, checked, in order.

        Stops at the first block the store lacks or that fails its check;
        a store that fails is `Loaded(0, error=...)`. Never raises a kvmesh error.
        """
        try:
            if self.shm and self._arena_seen:
                mapped = self.current()
                if mapped is not None:
                    slots = self._slots(mapped, digests)
                    loaded = self._copy_from_arena(mapped, digests, block_ids, slots)
                    return self._load_from_peers(digests, block_ids, loaded)
            return self._copy_from_fetch(digests, block_ids)
        except KVMeshError as exc:
            return Loaded(0, error=exc)

    def _slots(self, mapped: Mapped, digests: Sequence[bytes]) -> Sequence[int]:
        """Pages of the leading `digests` the store holds: read from its directory, or
        (`directory` off) answered by ``Locate``; one naming another arena is a miss, and
        that arena is mapped at the next load."""
        if self.directory:
            return mapped.arena.directory.leading(digests)
        located = self.client.locate(digests)
        pages = mapped.arena.layout.pages
        if located.arena != mapped.token:
            self._forget_mapping(mapped)
            return ()
        if not all(0 <= s < pages for s in located.slots):
            raise TransportError(f"store located pages outside its {pages} slots")
        return located.slots

    def _copy_from_arena(
        self,
        mapped: Mapped,
        digests: Sequence[bytes],
        block_ids: Sequence[int],
        slots: Sequence[int],
    ) -> Loaded:
        nbytes, layers = self.block_nbytes, self.layers
        for i, (slot, digest, block_id) in enumerate(zip(slots, digests, block_ids, strict=False)):
            layers.write(block_id, mapped.pages[slot])
            # the seal is read after the copy and checked against what was copied: a page
            # rewritten meanwhile (evicted, reused) fails, whichever part changed
            trailer = mapped.pages_np[slot, nbytes : nbytes + SEAL_BYTES].tobytes()
            try:
                check_seal(digest, trailer, layers.parts(block_id), nbytes)
            except KVMeshError as exc:
                self._touched.extend(digests[:i])
                return Loaded(i, refused=digest, error=exc)
        loaded = min(len(slots), len(digests))
        if self.directory:  # Locate touched them already
            self._touched.extend(digests[:loaded])
        return Loaded(loaded)

    def take_touched(self) -> list[bytes]:
        """The blocks loaded through the directory since the last call (for the next save)."""
        taken = []
        while self._touched:
            try:
                taken.append(self._touched.popleft())
            except IndexError:  # another thread took the last one
                break
        return taken

    def _load_from_peers(
        self, digests: Sequence[bytes], block_ids: Sequence[int], loaded: Loaded
    ) -> Loaded:
        """Go on with the blocks past `loaded` in the peer stores' arenas, in order."""
        done = loaded.blocks
        if loaded.refused is not None or loaded.error is not None:
            return loaded
        for i in range(len(self.peers)):
            if done >= len(digests):
                break
            peer = self._peer_mapped(i)
            if peer is None:
                continue
            rest = digests[done:]
            slots = peer.arena.directory.leading(rest)
            if not slots:
                continue
            more = self._copy_from_arena(peer, rest, block_ids[done:], slots)
            done += more.blocks
            if more.refused is not None:
                return Loaded(done, refused=more.refused, error=more.error)
        return Loaded(done)

    def _peer_mapped(self, i: int) -> Mapped | None:
        """Peer `i`'s arena, mapped here (anew once its file is gone); None when it cannot be
        (down, another host, no shared memory), asked again after `PEER_RETRY_S`."""
        mapped = self._peer_maps[i]
        if mapped is not None and not mapped.arena.gone():
            return mapped
        now = time.monotonic()
        if now < self._peer_retry[i]:
            return None
        self._peer_retry[i] = now + PEER_RETRY_S
        if mapped is not None:
            mapped.arena.close()
            self._peer_maps[i] = None
        try:
            layout = self.peers[i].describe().arena
            if layout is None:
                return None
            self._peer_maps[i] = Mapped(open_arena(layout))
        except KVMeshError as exc:
            log.info("kvmesh connector: peer %s's arena is not mapped here (%s)",
                     self.peers[i].control_address, exc)  # fmt: skip
        return self._peer_maps[i]

    def _copy_from_fetch(self, digests: Sequence[bytes], block_ids: Sequence[int]) -> Loaded:
        pages = self.client.fetch(digests)
        for i, (page, digest, block_id) in enumerate(zip(pages, digests, block_ids, strict=True)):
            if page is None:
                return Loaded(i)
            try:
                data = unseal(digest, page, self.block_nbytes)
            except KVMeshError as exc:
                return Loaded(i, refused=digest, error=exc)
            self.layers.write(block_id, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return Loaded(len(digests))

    # ------------------------------------------------------------------ save

    def stage(self, run: BlockRun, block_ids: Sequence[int]) -> PendingSave | None:
        """Copy a step's blocks out of the KV cache for the saver; None: no staging room now."""
        mapped = self._leased()
        if mapped is None:
            blocks = tuple(self.layers.block_bytes(b) for b in block_ids)
            return PendingSave(run, blocks=blocks)
        slots = mapped.slots.take(len(block_ids))
        if slots is None:
            return None
        nbytes = self.block_nbytes
        for slot, block_id, digest in zip(slots, block_ids, run.digests, strict=True):
            self.layers.read_into(block_id, mapped.staging[slot])
            # sealed over the KV cache's own bytes: staging written by anyone else since
            # (another client, a bug) fails the check on load, never passes as this block
            page = memoryview(mapped.staging_np[slot])
            seal_into(digest, page, self.layers.parts(block_id), nbytes)
        return PendingSave(run, slots=slots, staged=mapped)

    def _leased(self) -> Mapped | None:
        """The mapping this engine saves into, leasing its staging first; None: gRPC."""
        if not self.shm:
            return None
        with self._lock:
            mapped = self._mapped
            if mapped is not None and mapped.lease is not None:
                return mapped
        try:
            if mapped is None:
                self.connect()  # after a store restart: its new arena
            with self._lock:
                mapped = self._mapped
                if mapped is not None and mapped.lease is None:
                    mapped.lease = self.client.attach()
                return mapped
        except KVMeshError as exc:
            log.warning("kvmesh connector: cannot lease the store's staging (%s); gRPC", exc)
            return None

    def send(self, pending: PendingSave) -> list[bool]:
        """Save staged blocks (the saver thread); their slots come back either way.

        A store that refuses the lease (it restarted: a new arena; or another
        client leased its staging) is described and leased anew, and the
        sealed pages are moved into the new staging and saved once more (their
        seals were taken over the KV cache, so a page changed meanwhile is
        refused on load).
        """
        mapped = pending.staged
        if mapped is None:
            pages = [
                seal(d, b, self.page_bytes)
                for d, b in zip(pending.run.digests, pending.blocks, strict=True)
            ]
            return self.client.save(pending.run, pages)
        try:
            return self._save_staged(mapped, pending.run, pending.slots, self.take_touched())
        except ArenaUnavailable:
            self._forget_mapping(mapped)
            fresh = self._leased()
            if fresh is None or fresh is mapped:
                raise
            slots = fresh.slots.take(len(pending.slots))
            if slots is None:
                raise
            try:
                for old, new in zip(pending.slots, slots, strict=True):
                    fresh.staging_np[new] = mapped.staging_np[old]
                return self._save_staged(fresh, pending.run, slots)
            finally:
                fresh.slots.give(slots)
        finally:
            mapped.slots.give(pending.slots)

    def _save_staged(
        self, mapped: Mapped, run: BlockRun, slots: Sequence[int], touched: Sequence[bytes] = ()
    ) -> list[bool]:
        lease = mapped.lease
        if lease is None:
            raise ArenaUnavailable("the staging lease was given up; Attach again")
        return self.client.save_staged(run, lease, slots, touched)

    def release(self, pending: PendingSave) -> None:
        """Give back the slots of a save that will not be sent (dropped)."""
        if pending.staged is not None:
            pending.staged.slots.give(pending.slots)

    def _forget_mapping(self, mapped: Mapped) -> None:
        """A store that refused our lease restarted or leased to another: describe it anew."""
        with self._lock:
            if self._mapped is mapped:
                self._mapped = None
                mapped.arena.close()

    def close(self) -> None:
        with self._lock:
            if self._mapped is not None:
                self._mapped.arena.close()
                self._mapped = None
        for i, peer in enumerate(self._peer_maps):
            if peer is not None:
                peer.arena.close()
                self._peer_maps[i] = None
        for client in self.peers:
            client.close()
