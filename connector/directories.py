"""What the engine's store and its peer stores hold, read from their arenas with no call.

The scheduler decides, for every request before it is scheduled, how many
blocks past the engine's own hit the connector claims. Asking the store
(``Prepare``, a gRPC round trip) costs a busy engine more than it seems: the
scheduler waits for the answer, and an answer that comes late (the store's
process waiting for a core the engines hold) skips the request a whole
engine step (`kvmesh.benchmarks.connector_overhead` measured both). On one
host the store's shared-memory arena carries a directory of the blocks its
pool holds (`kvmesh.page_arena.PageDirectory`), so `StoreDirectories` answers
"how many leading blocks does my store hold" and "how many more do its
peers hold" by reading memory; a request a peer can add blocks to is claimed
from those counts too, and loaded asynchronously (the store pulls, then the
worker loads: `kvmesh.connector.vllm_connector`).

What a directory says may be a moment old: a block it names that has gone
fails its seal on load and is recomputed (never a wrong answer); a block it
misses is computed. Each store is mapped on first use and mapped again when
its file is gone (the store restarted); one that cannot be mapped (another
host, ``--no-shm``, down) is "unknown" and the connector asks by ``Prepare``
as before; a failed look is retried at most every `RETRY_S`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvmesh.connector.store_client import StoreClient
from kvmesh.errors import ArenaUnavailable, KVMeshError
from kvmesh.page_arena import DirectoryView, open_directory

log = logging.getLogger(__name__)

RETRY_S = 1.0
NO_ARENA_RETRY_S = 30.0  # a store that answered with no arena (--no-shm) is asked again this late


class _Directory:
    """One store's directory, mapped lazily: None while it cannot be read."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client
        self._view: DirectoryView | None = None
        self._next_try = 0.0
        self.peers: tuple[str, ...] = ()  # the store's own peers, from its Describe

    def view(self) -> DirectoryView | None:
        view = self._view
        if view is not None and not view.gone():
            return view
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + RETRY_S
        self.close()
        try:
            info = self.client.describe()
            self.peers = info.peers
            if info.arena is None:
                self._next_try = now + NO_ARENA_RETRY_S
            else:
                self._view = open_directory(info.arena)
        except ArenaUnavailable as exc:
            log.info("kvmesh connector: %s's directory cannot be mapped here (%s)",
                     self.client.control_address, exc)  # fmt: skip
        except KVMeshError:
            pass  # the store is down: unknown until it answers again
        return self._view

    def close(self) -> None:
        if self._view is not None:
            self._view.close()
            self._view = None


class StoreDirectories:
    """The engine's store and its peers (by control address), read from their directories.

    It owns the clients it is given (`close` closes them).
    """

    def __init__(self, store: StoreClient, peers: Sequence[StoreClient] = ()) -> None:
        self._own = _Directory(store)
        self._peers = [_Directory(p) for p in peers]
        self.peers_named = bool(peers)

    def held(self, digests: Sequence[bytes]) -> int | None:
        """Leading `digests` the engine's store holds; None when its directory is unknown."""
        view = self._own.view()
        return None if view is None else len(view.directory.leading(digests))

    def pulls_possible(self, configured_peers: Sequence[str]) -> bool:
        """Whether the store has peers to pull from (the engine's list, else the store's)."""
        return bool(configured_peers or self._own.peers)

    def peer_holds(self, digest: bytes) -> bool | None:
        """Whether a peer store holds `digest`; None when a peer's directory is unknown (a
        peer named by page address only, on another host, or down)."""
        if not self._peers:
            return None
        for peer in self._peers:
            view = peer.view()
            if view is None:
                return None
            if view.directory.leading([digest]):
                return True
        return False

    def peers_leading(self, digests: Sequence[bytes]) -> int | None:
        """How many leading `digests` the peer stores hold between them, taken as the store's
        ``Prepare`` pulls them (each peer in order, from where the one before stopped); None
        when a peer's directory is unknown."""
        if not self._peers:
            return None
        held = 0
        for peer in self._peers:
            if held == len(digests):
                break
            view = peer.view()
            if view is None:
                return None
            held += len(view.directory.leading(digests[held:]))
        return held

    def close(self) -> None:
        self._own.close()
        self._own.client.close()
        for peer in self._peers:
            peer.close()
            peer.client.close()
