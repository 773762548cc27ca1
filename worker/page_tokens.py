"""The token ids of a worker's cached pages, kept so that it can show a page's chain.

A receiver never takes a sender's word for a page (`kvmesh.worker.page_proofs`),
but tools and older receivers read the tokens a sender offers beside a page.
A sender offers them only when they prove the page's hash with no extra keys
but LoRA: a salted or multimodal page hashes from keys the sender's pool does
not keep, so its tokens are withheld rather than offered unprovable.

The pool does not keep token ids, so they are learnt from its `PagesStored`
events and from pages taken in, and forgotten on `PagesRemoved` and
`AllPagesCleared`. Events drained by someone else are missed; `learn` prunes
the memory back to the cached set when it outgrows twice the pool.

Not thread-safe: `PageService` calls it under its pool lock (`prove` is pure
and may run outside it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvmesh.errors import InvalidInput
from kvmesh.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored
from kvmesh.hashing import ExtraKeys, PageHasher
from kvmesh.types import PageHash


class PageTokens:
    """`PageHash -> token ids` for cached pages; bounded by `2 * num_pages` entries."""

    __slots__ = ("_tokens", "hasher", "num_pages")

    def __init__(self, hasher: PageHasher, num_pages: int) -> None:
        self.hasher = hasher
        self.num_pages = num_pages
        self._tokens: dict[PageHash, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, page_hash: object) -> bool:
        return page_hash in self._tokens

    def get(self, page_hash: PageHash) -> tuple[int, ...] | None:
        return self._tokens.get(page_hash)

    def remember(self, page_hash: PageHash, token_ids: tuple[int, ...]) -> None:
        """Tokens of a page just cached under `page_hash` (proven by the caller)."""
        self._tokens[page_hash] = token_ids

    def learn(self, events: Iterable[KVEvent], cached: Callable[[], set[PageHash]]) -> None:
        """Follow the pool's events; `cached` (the pool's cached hashes) is asked only to prune."""
        tokens = self._tokens
        size = self.hasher.page_size
        for ev in events:
            if isinstance(ev, PagesStored):
                if len(ev.token_ids) == size * len(ev.page_hashes):
                    for i, h in enumerate(ev.page_hashes):
                        tokens[h] = tuple(ev.token_ids[i * size : (i + 1) * size])
            elif isinstance(ev, PagesRemoved):
                for h in ev.page_hashes:
                    tokens.pop(h, None)
            elif isinstance(ev, AllPagesCleared):
                tokens.clear()
        if len(tokens) > 2 * self.num_pages:
            held = cached()
            for h in [h for h in tokens if h not in held]:
                del tokens[h]

    def provable(
        self,
        page_hash: PageHash,
        parent: PageHash | None,
        token_ids: Sequence[int] | None,
        lora_id: int | None,
    ) -> tuple[int, ...]:
        """`token_ids` when they hash to `page_hash` with only LoRA as extra key, else ``()``.

        One page hash; pure, so callers run it outside their lock.
        """
        if not token_ids:
            return ()
        extra = ExtraKeys(lora_id=lora_id).for_page(0, self.hasher.page_size)
        try:
            proven = self.hasher.hash_page(parent, token_ids, extra) == page_hash
        except InvalidInput:
            return ()
        return tuple(token_ids) if proven else ()
