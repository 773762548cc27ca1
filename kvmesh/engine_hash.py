"""Hash a prompt exactly as a vLLM engine hashes its KV blocks.

kvmesh indexes a real engine by the block hashes in the engine's own KV
events, so a request is routed by cache affinity only if kvmesh computes the
very same hashes from the request's token ids. vLLM (v1, 0.32) hashes each
full block of ``block_size`` tokens, chained::

    NONE   = H(seed)                    seed = the engine's PYTHONHASHSEED, else "vllm-none-hash"
    hash_0 = H((NONE,       tuple(tokens[0:B]),  extra_keys(block 0)))
    hash_i = H((hash_{i-1}, tuple(tokens[iB:(i+1)B]), extra_keys(block i)))

where ``H`` serialises its argument and takes SHA-256 of it: ``sha256``
pickles (protocol 5), ``sha256_cbor`` writes canonical CBOR; ``xxhash`` and
``xxhash_cbor`` take xxh3-128 of the same bytes (the engine seeds those with
random bytes unless PYTHONHASHSEED is set, so kvmesh can match them only
with a seed). Pickling here only serialises kvmesh's own values; nothing is
ever unpickled.

Extra keys are ``None`` or a tuple, in this order: the LoRA adapter
``("lora", name, path)`` on every block, each multimodal input overlapping the
block ``("mm", identifier, offset of the input relative to the block start)``,
and ``("cache_salt", salt)`` on the first block only.

Events carry each hash either as the 32-byte digest or, by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), as the digest's low 64 bits as
an unsigned int; kvmesh stores that int as 8 bytes big-endian, which are the
digest's last 8 bytes. Either way the chain itself always uses full digests.
A hasher must be configured as its engine is (algorithm, seed, block size,
int form); the hash-parity canary (`kvmesh.engine_canary`) proves it.
"""

from __future__ import annotations

import hashlib
import operator
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import xxhash

from kvmesh.errors import ConfigError, InvalidInput
from kvmesh.types import PageHash

DEFAULT_ENGINE_SEED = "vllm-none-hash"
"""vLLM's NONE_HASH seed when the engine has no PYTHONHASHSEED (cryptographic algorithms)."""

PICKLE_PROTOCOL = 5
INT_HASH_BYTES = 8
_INT_MASK = (1 << 64) - 1

ExternalHash = int | bytes
"""A block hash as an engine's events carry it: a 64-bit int or a digest."""


def _pickle(value: Any) -> bytes:
    return pickle.dumps(value, protocol=PICKLE_PROTOCOL)


def _cbor(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass(frozen=True, slots=True)
class EngineHashAlgorithm:
    """One of the engine's block hash algorithms: how a value is serialised, then digested.

    `needs_seed`: the engine seeds it with random bytes unless PYTHONHASHSEED
    is set, so a kvmesh hasher must be given that seed.
    """

    name: str
    serialize: Callable[[Any], bytes]
    digest: Callable[[bytes], bytes]
    needs_seed: bool = False

    def __call__(self, value: Any) -> bytes:
        return self.digest(self.serialize(value))


ENGINE_HASH_ALGORITHMS: dict[str, EngineHashAlgorithm] = {
    a.name: a
    for a in (
        EngineHashAlgorithm("sha256", _pickle, _sha256),
        EngineHashAlgorithm("sha256_cbor", _cbor, _sha256),
        EngineHashAlgorithm("xxhash", _pickle, xxhash.xxh3_128_digest, needs_seed=True),
        EngineHashAlgorithm("xxhash_cbor", _cbor, xxhash.xxh3_128_digest, needs_seed=True),
    )
}
"""Registry of vLLM's ``--prefix-caching-hash-algo`` values."""


@dataclass(frozen=True, slots=True)
class MultimodalInput:
    """A multimodal input's placeholder tokens in the prompt, named by the engine's content hash."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class EngineExtraKeys:
    """What besides token ids goes into the engine's block hashes.

    `lora_path` must be the adapter path the engine was given for
    `lora_name` (vLLM keys blocks by both). `multimodal` lists inputs sorted
    by offset, non-overlapping. Prompt embeddings are not supported: kvmesh
    forwards token ids.
    """

    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    multimodal: tuple[MultimodalInput, ...] = ()

    def __post_init__(self) -> None:
        if self.lora_name is not None and self.lora_path is None:
            raise InvalidInput(
                f"LoRA {self.lora_name!r} needs its lora_path as the engine loaded it: "
                "vLLM hashes blocks with the adapter's name and path"
            )
        if self.cache_salt == "":
            raise InvalidInput("cache_salt must be a non-empty string or None")
        end = 0
        for mm in self.multimodal:
            if mm.offset < end or mm.length <= 0:
                raise InvalidInput(
                    f"multimodal input {mm.identifier!r} at {mm.offset}+{mm.length}: inputs "
                    "must be sorted by offset, non-overlapping, with a positive length"
                )
            end = mm.offset + mm.length

    def for_block(self, start: int, end: int) -> tuple[Any, ...] | None:
        """The extra keys of the block of tokens [start, end), as the engine builds them."""
        keys: list[tuple[Any, ...]] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path))
        for mm in self.multimodal:
            if mm.offset >= end:
                break
            if mm.offset + mm.length > start:
                keys.append(("mm", mm.identifier, mm.offset - start))
        if start == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None


NO_EXTRA_KEYS = EngineExtraKeys()


def external_to_page_hash(value: ExternalHash) -> PageHash:
    """An event's block hash as a kvmesh `PageHash`: an int as 8 bytes big-endian, a digest as is.

    Ints are taken modulo 2**64, so the signed 64-bit ints of older vLLM map
    to the same bytes as their unsigned form.
    """
    if isinstance(value, bytes):
        return PageHash(value)
    return PageHash((value & _INT_MASK).to_bytes(INT_HASH_BYTES, "big"))


@dataclass(frozen=True, slots=True)
class BlockHashes:
    """A prompt's full blocks hashed: the chain's digests and the hashes its events carry."""

    digests: tuple[bytes, ...]
    page_hashes: tuple[PageHash, ...]


class EngineHasher:
    """Hashes token ids into the block hashes of one engine configuration.

    Pure and thread-safe (no mutable state). `seed` is the engine's
    PYTHONHASHSEED (None when unset). `int_hashes`: the engine publishes
    64-bit ints (vLLM's default), so page hashes are 8 bytes; else 32-byte
    digests. Cost: one serialisation and one digest per full block.
    """

    __slots__ = ("algorithm", "block_size", "int_hashes", "none_hash", "seed")

    def __init__(
        self,
        algo: str = "sha256",
        block_size: int = 16,
        seed: str | None = None,
        int_hashes: bool = True,
    ) -> None:
        algorithm = ENGINE_HASH_ALGORITHMS.get(algo)
        if algorithm is None:
            raise ConfigError(
                f"unknown engine hash algorithm {algo!r}; known: {sorted(ENGINE_HASH_ALGORITHMS)}"
            )
        if type(block_size) is not int or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        if seed is None and algorithm.needs_seed:
            raise ConfigError(
                f"vLLM seeds {algo!r} with random bytes unless PYTHONHASHSEED is set: "
                "start the engine with PYTHONHASHSEED and give kvmesh the same seed"
            )
        self.algorithm = algorithm
        self.block_size = block_size
        self.seed = seed
        self.int_hashes = int_hashes
        self.none_hash = algorithm(DEFAULT_ENGINE_SEED if seed is None else seed)

    def __repr__(self) -> str:
        return (
            f"EngineHasher(algo={self.algorithm.name!r}, block_size={self.block_size}, "
            f"seed={self.seed!r}, int_hashes={self.int_hashes})"
        )

    def to_page_hash(self, digest: bytes) -> PageHash:
        """A block digest in the form this engine's events carry it."""
        return PageHash(digest[-INT_HASH_BYTES:] if self.int_hashes else digest)

    def hash_blocks(
        self, tokens: Sequence[int], extra: EngineExtraKeys = NO_EXTRA_KEYS
    ) -> BlockHashes:
        """Digests and page hashes of every full block of `tokens`; a partial tail is not hashed."""
        ids = _token_tuple(tokens)
        size = self.block_size
        algorithm = self.algorithm
        parent = self.none_hash
        digests: list[bytes] = []
        for start in range(0, len(ids) - size + 1, size):
            end = start + size
            parent = algorithm((parent, ids[start:end], extra.for_block(start, end)))
            digests.append(parent)
        return BlockHashes(tuple(digests), tuple(self.to_page_hash(d) for d in digests))

    def hash_prompt(
        self, tokens: Sequence[int], extra: EngineExtraKeys = NO_EXTRA_KEYS
    ) -> list[PageHash]:
        """The page hashes the engine's events carry for the full blocks of `tokens`."""
        return list(self.hash_blocks(tokens, extra).page_hashes)


def _token_tuple(tokens: Sequence[int]) -> tuple[int, ...]:
    """Token ids as a tuple of Python ints, the exact values the engine pickles."""
    try:
        ids = tuple(map(operator.index, tokens))
    except TypeError as exc:
        raise InvalidInput(f"token ids must be integers: {exc}") from exc
    if any(type(t) is bool for t in tokens) or (ids and min(ids) < 0):
        raise InvalidInput("token ids must be non-negative integers")
    return ids
