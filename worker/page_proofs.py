"""What a receiver knows of the pages it may take, and what it lets pushers do.

`ProofBook`: the receiver's own proof of every page it may accept, built
from the request it serves (its tokens and extra keys: LoRA, salt, media),
never from what a sender claims; a page proves its hash when the receiver
recomputes ``hash(parent, tokens, extra) == page_hash`` (`PageService.prove`).
`PushGrants`: one-use tickets for the pushes a worker agreed to take, each
holding the book of the request routed to it. `EvictionBudget`: how many
cached pages each pusher may still evict. Pure: no pool, no transport.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.errors import InvalidInput, PermissionDenied
from kvmesh.hashing import ExtraKeys, PageHasher
from kvmesh.types import PageHash


@dataclass(frozen=True, slots=True)
class PageProof:
    """What a receiver itself knows of a page it may accept: enough to recompute its hash."""

    parent_hash: PageHash | None
    token_ids: tuple[int, ...]
    extra: tuple[Any, ...] | None = None  # `ExtraKeys.for_page` of this page

    @property
    def lora_id(self) -> int | None:
        return None if self.extra is None else self.extra[0]


class ProofBook:
    """The pages a receiver may accept, each with the proof it recomputes the hash from.

    Built by the receiver from the request it serves (`for_prompt`, `for_pages`), never
    from what a sender claims. A hash outside the book is refused.
    """

    __slots__ = ("_proofs",)

    def __init__(self, proofs: Mapping[PageHash, PageProof]) -> None:
        self._proofs = dict(proofs)

    @classmethod
    def for_prompt(
        cls, hasher: PageHasher, token_ids: Sequence[int], extra: ExtraKeys
    ) -> ProofBook:
        """Proofs for every full page of a prompt, hashed with `hasher`."""
        hashes = hasher.hash_prompt(token_ids, extra)
        return cls.for_pages(hashes, token_ids, extra, hasher.page_size)

    @classmethod
    def for_pages(
        cls,
        hashes: Sequence[PageHash],
        token_ids: Sequence[int],
        extra: ExtraKeys,
        page_size: int,
        *,
        first_page: int = 0,
        parent: PageHash | None = None,
    ) -> ProofBook:
        """Proofs for consecutive pages of a prompt: `hashes` and their `token_ids` from page
        `first_page` on, `parent` the hash before it (None: the prompt's first page)."""
        if len(token_ids) < len(hashes) * page_size:
            raise InvalidInput(
                f"{len(token_ids)} tokens cannot prove {len(hashes)} pages of {page_size} tokens"
            )
        proofs: dict[PageHash, PageProof] = {}
        for i, h in enumerate(hashes):
            tokens = tuple(token_ids[i * page_size : (i + 1) * page_size])
            proofs[h] = PageProof(parent, tokens, extra.for_page(first_page + i, page_size))
            parent = h
        return cls(proofs)

    def get(self, page_hash: PageHash) -> PageProof | None:
        return self._proofs.get(page_hash)

    @property
    def hashes(self) -> tuple[PageHash, ...]:
        """The provable hashes, in prompt order."""
        return tuple(self._proofs)

    def __len__(self) -> int:
        return len(self._proofs)

    def __contains__(self, page_hash: object) -> bool:
        return page_hash in self._proofs


NO_PROOFS = ProofBook({})


@dataclass(slots=True)
class _Grant:
    proofs: ProofBook
    expires: float


class PushGrants:
    """One-use tickets for the pushes a worker agreed to take (prefill -> decode).

    The worker a request is routed to grants a ticket for that request's pages
    (`grant`); the pusher presents it and the push is proven against the book
    the grant holds (`take`, which consumes it). Tickets are 128-bit secrets
    that travel only between cluster members; they expire after `ttl_s`, and
    at most `max_grants` are open at once (the oldest is dropped first).
    """

    __slots__ = ("_clock", "_grants", "_lock", "max_grants", "ttl_s")

    def __init__(
        self,
        ttl_s: float = 60.0,
        max_grants: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or max_grants < 1:
            raise InvalidInput(
                f"push grants need ttl_s > 0 and max_grants >= 1, got {ttl_s}, {max_grants}"
            )
        self.ttl_s = ttl_s
        self.max_grants = max_grants
        self._clock = clock
        self._grants: dict[bytes, _Grant] = {}
        self._lock = threading.Lock()

    def grant(self, proofs: ProofBook) -> bytes:
        """A fresh ticket for pushes of the pages in `proofs`."""
        ticket = secrets.token_bytes(16)
        now = self._clock()
        with self._lock:
            for old in [t for t, g in self._grants.items() if g.expires <= now]:
                del self._grants[old]
            while len(self._grants) >= self.max_grants:
                del self._grants[next(iter(self._grants))]
            self._grants[ticket] = _Grant(proofs, now + self.ttl_s)
        return ticket

    def take(self, ticket: bytes) -> ProofBook:
        """The book of a live ticket, consuming it; `PermissionDenied` for none, unknown or expired."""
        if not ticket:
            raise PermissionDenied(
                "a push without a grant is refused: a worker takes pushed pages only for a "
                "request routed to it (prefill -> decode), with the ticket it granted"
            )
        with self._lock:
            grant = self._grants.pop(ticket, None)
        if grant is None or grant.expires <= self._clock():
            raise PermissionDenied(
                "the push ticket is unknown, used or expired: pushes are taken only for a "
                "request routed to this worker, once, within the grant's time to live"
            )
        return grant.proofs

    def __len__(self) -> int:
        with self._lock:
            return len(self._grants)


class EvictionBudget:
    """How many cached pages each pusher may still evict: a token bucket per peer.

    `capacity` pages at most, refilled at ``capacity / window_s`` per second,
    so a peer's pushes can flush at most that share of the pool per window
    while other tenants' pages stay.
    """

    __slots__ = ("_clock", "_lock", "_peers", "capacity", "window_s")

    def __init__(
        self, capacity: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity < 0 or window_s <= 0:
            raise InvalidInput(
                f"an eviction budget needs capacity >= 0 and window_s > 0, got {capacity}, "
                f"{window_s}"
            )
        self.capacity = capacity
        self.window_s = window_s
        self._clock = clock
        self._peers: dict[str, tuple[float, float]] = {}  # peer -> (tokens, as of)
        self._lock = threading.Lock()

    def available(self, peer: str) -> int:
        """Pages `peer` may evict now."""
        with self._lock:
            return int(self._refill(peer))

    def spend(self, peer: str, pages: int) -> None:
        """Charge `peer` for `pages` evicted (never below zero)."""
        if pages <= 0:
            return
        with self._lock:
            self._peers[peer] = (max(0.0, self._refill(peer) - pages), self._clock())

    def _refill(self, peer: str) -> float:
        now = self._clock()
        tokens, then = self._peers.get(peer, (float(self.capacity), now))
        tokens = min(float(self.capacity), tokens + (now - then) * self.capacity / self.window_s)
        self._peers[peer] = (tokens, now)
        if len(self._peers) > 4096:  # forget peers whose buckets are full again
            full = [p for p, (t, _) in self._peers.items() if t >= self.capacity and p != peer]
            for p in full:
                del self._peers[p]
        return tokens


__all__ = ["NO_PROOFS", "EvictionBudget", "PageProof", "ProofBook", "PushGrants"]
