"""Chained page hashing: the identity of a KV page across the cluster.

A page is `page_size` tokens; only full pages are hashed::

    root   = H("kvmesh-root" | seed)                      per cluster
    hash_0 = H(root   | tokens[0:P]   | extras(page 0))   salt, LoRA, media
    hash_i = H(hash_{i-1} | tokens[iP:(i+1)P] | extras(page i))

so a page hash names its whole prefix. The canonical encoding is fixed-width:
the parent digest, the token count as uint32, the token ids as little-endian
uint32, then (only when there are any) the extra keys as msgpack. `H` is
SHA-256 by default or xxh3-128 by config; Python's `hash()` is never used.

Extra keys: the LoRA adapter id goes into every page (it changes all KV), a
multimodal input goes into the pages its token range overlaps, and the
`cache_salt` goes into the first page only, which is enough because every
later page chains from it: two salts never share a single page.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from kvmesh.config import DEFAULT_SEED, HashConfig
from kvmesh.errors import ConfigError, InvalidInput
from kvmesh.types import PageHash

HashFn = Callable[[bytes], bytes]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": _sha256,
    "xxh3_128": xxhash.xxh3_128_digest,
}
"""Registry of page hash functions by config name."""

_BIG_ENDIAN = sys.byteorder == "big"
_COUNT = struct.Struct("<I")
_MAX_TOKEN = 2**32 - 1
MAX_LORA_ID = 2**63 - 1
"""Largest LoRA adapter id: it travels as int64 (proto, KV events, torch.distributed meta)."""


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; rejects anything else clearly."""
    if hasattr(tokens, "dtype") and hasattr(tokens, "tobytes"):  # numpy / torch-like arrays
        return _encode_array_like(tokens)
    try:
        arr = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise InvalidInput(f"token ids must be integers in [0, {_MAX_TOKEN}]: {exc}") from exc
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms
        return struct.pack(f"<{len(arr)}I", *arr)
    if _BIG_ENDIAN:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def _encode_array_like(tokens: Any) -> bytes:
    import numpy as np

    arr = np.asarray(tokens)
    if arr.size and (
        arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN
    ):
        raise InvalidInput(
            f"token ids must be integers in [0, {_MAX_TOKEN}], got dtype {arr.dtype}"
        )
    return np.ascontiguousarray(arr, dtype="<u4").tobytes()


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """An image/audio input: its content hash and the prompt tokens it occupies."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise InvalidInput(
                f"multimodal input {self.identifier!r} needs offset >= 0 and length > 0, "
                f"got offset={self.offset} length={self.length}"
            )


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Whatever changes the KV of the same tokens: LoRA, media, tenant salt."""

    lora_id: int | None = None
    mm_inputs: tuple[MultiModalInput, ...] = ()
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # Checked here, where every request's keys are built (client, worker, received
        # pages), so a bad id is one InvalidInput and never msgpack's OverflowError.
        lora = self.lora_id
        if lora is not None and (
            isinstance(lora, bool) or not isinstance(lora, int) or not 0 <= lora <= MAX_LORA_ID
        ):
            raise InvalidInput(
                f"lora_id must be None or an integer in [0, 2**63 - 1] (it travels as int64), "
                f"got {lora!r}"
            )
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidInput(
                f"cache_salt must be a string or None, got {type(self.cache_salt).__name__}"
            )

    def for_page(self, index: int, page_size: int) -> tuple[Any, ...] | None:
        """The extra keys that page `index` carries, or None when it has none."""
        start, end = index * page_size, (index + 1) * page_size
        media = tuple(
            (m.identifier, m.offset)
            for m in self.mm_inputs
            if m.offset < end and m.offset + m.length > start
        )
        salt = self.cache_salt if index == 0 else None
        if self.lora_id is None and not media and salt is None:
            return None
        return (self.lora_id, media, salt)


NO_EXTRA = ExtraKeys()


class PageHasher:
    """Computes chained page hashes for one cluster (seed) and page size.

    Cost: one hash call per full page over ``digest + 4 + 4 * page_size`` bytes.
    """

    __slots__ = ("_fn", "algo", "digest_size", "page_size", "root_hash", "seed")

    def __init__(self, page_size: int, seed: str = DEFAULT_SEED, algo: str = "sha256") -> None:
        if page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {page_size}")
        try:
            self._fn = HASH_FUNCTIONS[algo]
        except KeyError:
            raise ConfigError(
                f"unknown hash algorithm {algo!r}; choose one of {sorted(HASH_FUNCTIONS)}"
            ) from None
        self.page_size = page_size
        self.algo = algo
        self.seed = seed
        self.root_hash = PageHash(self._fn(b"kvmesh-root\x00" + seed.encode()))
        self.digest_size = len(self.root_hash)

    @classmethod
    def from_config(cls, cfg: HashConfig) -> PageHasher:
        return cls(cfg.page_size, cfg.seed, cfg.algo)

    def hash_page(
        self, parent: PageHash | None, tokens: Sequence[int], extra: tuple[Any, ...] | None = None
    ) -> PageHash:
        """Hash one full page chained to `parent` (None: the cluster root)."""
        if len(tokens) != self.page_size:
            raise InvalidInput(f"a page holds exactly {self.page_size} tokens, got {len(tokens)}")
        head = self.root_hash if parent is None else parent
        if len(head) != self.digest_size:
            raise InvalidInput(
                f"parent hash must be {self.digest_size} bytes for {self.algo}, got {len(head)}"
            )
        data = head + _COUNT.pack(self.page_size) + encode_tokens(tokens)
        if extra is not None:
            data += msgpack.packb(extra, use_bin_type=True)
        return PageHash(self._fn(data))

    def hash_prompt(
        self, tokens: Sequence[int], keys: ExtraKeys = NO_EXTRA, parent: PageHash | None = None
    ) -> list[PageHash]:
        """Chained hashes of every full page of `tokens` (a trailing partial page is skipped)."""
        return self.extend_hashes([], tokens, keys, parent)

    def extend_hashes(
        self,
        hashes: list[PageHash],
        tokens: Sequence[int],
        keys: ExtraKeys = NO_EXTRA,
        parent: PageHash | None = None,
    ) -> list[PageHash]:
        """Append to `hashes` the hashes of the full pages of `tokens` not hashed yet."""
        p = self.page_size
        full = len(tokens) // p
        prev = hashes[-1] if hashes else parent
        for i in range(len(hashes), full):
            prev = self.hash_page(prev, tokens[i * p : (i + 1) * p], keys.for_page(i, p))
            hashes.append(prev)
        return hashes


def reusable_pages(num_tokens: int, page_size: int) -> int:
    """How many leading full pages of a `num_tokens` prompt a cache hit may cover.

    Never the last token: the answer needs its logits, so it is always
    computed, and a prompt of whole pages recomputes its last page. Routers,
    clients, simulators and workers all clamp with this one rule.
    """
    return (num_tokens - 1) // page_size if num_tokens > 0 else 0


class RequestHashes:
    """A request's tokens and their page hashes, extended incrementally.

    `extend` hashes only the pages the new tokens complete, so decoding a long
    answer costs one hash per `page_size` tokens, not one per step.
    """

    __slots__ = ("hasher", "hashes", "keys", "token_ids")

    def __init__(
        self, hasher: PageHasher, token_ids: Sequence[int] = (), keys: ExtraKeys = NO_EXTRA
    ) -> None:
        self.hasher = hasher
        self.keys = keys
        self.token_ids: list[int] = list(token_ids)
        self.hashes: list[PageHash] = hasher.hash_prompt(self.token_ids, keys)

    @classmethod
    def given(
        cls,
        hasher: PageHasher,
        token_ids: Sequence[int],
        keys: ExtraKeys,
        hashes: Sequence[PageHash],
    ) -> RequestHashes | None:
        """The request's hashes as its sender computed them, if they pass a cheap check;
        None when they do not (hash the tokens yourself then).

        Two page hashes instead of one per page: the first page (its parent is
        the cluster root, so it catches another seed) and the last (it chains
        from the sender's previous hash, so it catches another algorithm, page
        size, salt or LoRA at the chain's end). A sender that disagrees
        anywhere in between is a trusted caller's bug, not a threat: pages
        received from peers are still proven one by one (`ProofBook`).
        """
        p = hasher.page_size
        tokens = list(token_ids)
        full = len(tokens) // p
        if len(hashes) != full:
            return None
        if full:
            last = full - 1
            try:
                first = hasher.hash_page(None, tokens[:p], keys.for_page(0, p))
                parent = hashes[last - 1] if last else None
                end = hasher.hash_page(parent, tokens[last * p : full * p], keys.for_page(last, p))
            except InvalidInput:  # e.g. a parent of another digest size
                return None
            if first != hashes[0] or end != hashes[last]:
                return None
        out = cls.__new__(cls)
        out.hasher, out.keys, out.token_ids, out.hashes = hasher, keys, tokens, list(hashes)
        return out

    def extend(self, new_tokens: Sequence[int]) -> list[PageHash]:
        """Add tokens; return only the hashes of pages completed by them."""
        before = len(self.hashes)
        self.token_ids.extend(new_tokens)
        self.hasher.extend_hashes(self.hashes, self.token_ids, self.keys)
        return self.hashes[before:]
