"""A KV block as the engine's store holds it: the block's bytes sealed with its digest.

The connector writes each full block the engine computed as one store page::

    ┌──────────── block bytes (every layer, the engine's layout) ────────────┐┌ seal ┐┌ pad ┐
    seal = b"KVMSEAL1" | digest (32 bytes) | block nbytes (u64 LE) | xxh3-128(digest | bytes)

padded with zeros to a multiple of ``2 * block_size`` bytes (the store's page
shape). The seal is written by the engine that computed the block and
checked by the engine that loads it, so what travels between them (the
store, a peer's store, the wire) can neither corrupt a block unseen nor
hand over another block's bytes: `unseal` refuses a page whose digest is not
the one asked for (`HashMismatch`) or whose bytes do not match the checksum
(`ChecksumMismatch`); the connector then recomputes the block. The digest
itself is proven from the block's tokens by the store when it takes the page
(`kvmesh.worker.engine_store`). xxh3-128 catches corruption, not forgery: a
store is a cluster member, trusted like every kvmesh worker.

Pure: no vLLM, no torch, no gRPC.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvmesh.errors import ChecksumMismatch, HashMismatch, InvalidInput, PageFormatError

SEAL_MAGIC = b"KVMSEAL1"
DIGEST_BYTES = 32
_SEAL = struct.Struct(f"<8s{DIGEST_BYTES}sQ16s")
SEAL_BYTES = _SEAL.size  # 64


def sealed_page_bytes(block_nbytes: int, block_size: int) -> int:
    """A sealed block's size in the store: bytes + seal, rounded up to ``2 * block_size``."""
    if block_nbytes <= 0 or block_size <= 0:
        raise InvalidInput(
            f"a block needs positive bytes and size, got {block_nbytes} bytes, {block_size} tokens"
        )
    unit = 2 * block_size
    return -(-(block_nbytes + SEAL_BYTES) // unit) * unit


def _checksum(digest: bytes, *parts: bytes | memoryview) -> bytes:
    h = xxhash.xxh3_128()
    h.update(digest)
    for part in parts:
        h.update(part)
    return h.digest()


def seal(digest: bytes, data: bytes | memoryview, page_bytes: int) -> bytes:
    """One store page holding `data` (a block's bytes) sealed with its `digest`."""
    if len(digest) != DIGEST_BYTES:
        raise InvalidInput(f"a block digest is {DIGEST_BYTES} bytes, got {len(digest)}")
    size = memoryview(data).nbytes
    if size + SEAL_BYTES > page_bytes:
        raise PageFormatError(
            f"a block of {size} bytes and its seal do not fit a {page_bytes}-byte page; start "
            "the store with sealed_page_bytes(block bytes, block size)"
        )
    trailer = _SEAL.pack(SEAL_MAGIC, digest, size, _checksum(digest, data))
    return b"".join((data, trailer, bytes(page_bytes - size - SEAL_BYTES)))


def seal_into(
    digest: bytes, page: memoryview, source: Sequence[bytes | memoryview], block_nbytes: int
) -> None:
    """Seal, in place, a page whose first `block_nbytes` bytes were copied from `source`.

    What `seal` makes, without copying the bytes again: the seal goes after
    them and the rest of the page is zeroed. The checksum is taken over
    `source` (the block where it was computed, layer by layer), not over the
    page: a page written by someone else since the copy fails its check on
    load instead of being sealed as this block.
    """
    if len(digest) != DIGEST_BYTES:
        raise InvalidInput(f"a block digest is {DIGEST_BYTES} bytes, got {len(digest)}")
    if block_nbytes + SEAL_BYTES > page.nbytes:
        raise PageFormatError(
            f"a block of {block_nbytes} bytes and its seal do not fit a {page.nbytes}-byte page"
        )
    if sum(memoryview(p).nbytes for p in source) != block_nbytes:
        raise PageFormatError(f"{len(source)} parts do not add up to a {block_nbytes}-byte block")
    end = block_nbytes + SEAL_BYTES
    checksum = _checksum(digest, *source)
    page[block_nbytes:end] = _SEAL.pack(SEAL_MAGIC, digest, block_nbytes, checksum)
    page[end:] = bytes(page.nbytes - end)


def seal_of(page: bytes | memoryview, block_nbytes: int) -> bytes:
    """A copy of the seal of a page holding a `block_nbytes`-byte block (checked by `check_seal`)."""
    return bytes(memoryview(page)[block_nbytes : block_nbytes + SEAL_BYTES])


def check_seal(
    digest: bytes, seal_bytes: bytes, parts: Sequence[bytes | memoryview], block_nbytes: int
) -> None:
    """Raise unless `parts` (a block's bytes, in order, wherever they were copied to) are
    block `digest` as sealed by `seal_bytes`.

    The check for bytes already copied out of a page (into the engine's KV
    cache, layer by layer): what was copied is what is checked, so a page
    overwritten while it was copied is refused, never used. Raises as `unseal`.
    """
    if len(seal_bytes) != SEAL_BYTES:
        raise PageFormatError(f"a seal is {SEAL_BYTES} bytes, got {len(seal_bytes)}")
    magic, sealed_digest, size, checksum = _SEAL.unpack(seal_bytes)
    if magic != SEAL_MAGIC or size != block_nbytes:
        raise PageFormatError(
            f"page has no seal for a {block_nbytes}-byte block (magic {magic!r}, size {size}): "
            "it was written by another layout or model"
        )
    if sealed_digest != digest:
        raise HashMismatch(
            f"page sealed as block {sealed_digest.hex()[:16]} was handed over as "
            f"{digest.hex()[:16]}"
        )
    if sum(memoryview(p).nbytes for p in parts) != block_nbytes:
        raise PageFormatError(f"{len(parts)} parts do not add up to a {block_nbytes}-byte block")
    if _checksum(digest, *parts) != checksum:
        raise ChecksumMismatch(
            f"block {digest.hex()[:16]}: its bytes no longer match the checksum sealed when it "
            "was computed; the block is recomputed"
        )


def unseal(digest: bytes, page: bytes | memoryview, block_nbytes: int) -> memoryview:
    """The block bytes of a sealed `page`, after checking it is block `digest`, whole.

    Raises `PageFormatError` (wrong size or no seal), `HashMismatch` (the page
    is another block's) or `ChecksumMismatch` (its bytes changed since the seal).
    """
    view = memoryview(page)
    if view.nbytes < block_nbytes + SEAL_BYTES:
        raise PageFormatError(
            f"page of {view.nbytes} bytes cannot hold a {block_nbytes}-byte block and its seal"
        )
    data = view[:block_nbytes]
    check_seal(digest, seal_of(view, block_nbytes), (data,), block_nbytes)
    return data


@dataclass(frozen=True, slots=True)
class BlockRun:
    """Consecutive full blocks of one request: what the store proves their digests from.

    `parent` is the digest before the first block (None: the request's
    first block), `tokens` the blocks' tokens, `extra` each block's extra keys
    as the engine built them (LoRA, media, cache_salt).
    """

    parent: bytes | None
    digests: tuple[bytes, ...]
    tokens: tuple[int, ...]
    extra: tuple[tuple[Any, ...] | None, ...]

    def __post_init__(self) -> None:
        if len(self.extra) != len(self.digests):
            raise InvalidInput(f"{len(self.digests)} blocks but {len(self.extra)} extra keys")

    def wire(self) -> dict[str, Any]:
        """The run as a control call's msgpack fields."""
        return {
            "parent": self.parent,
            "digests": list(self.digests),
            "tokens": list(self.tokens),
            "extra": list(self.extra),
        }

    def __len__(self) -> int:
        return len(self.digests)


def block_run(
    digests: Sequence[bytes],
    tokens: Sequence[int],
    extra: Sequence[tuple[Any, ...] | None],
    start: int,
    end: int,
    block_size: int,
) -> BlockRun:
    """Blocks [start, end) of a request whose block digests, tokens and extra keys are given."""
    return BlockRun(
        parent=digests[start - 1] if start > 0 else None,
        digests=tuple(digests[start:end]),
        tokens=tuple(tokens[start * block_size : end * block_size]),
        extra=tuple(extra[start:end]),
    )
