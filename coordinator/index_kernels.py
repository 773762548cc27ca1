"""A `PageStore`'s hot loops, compiled with numba: its lookup table and a prompt's walk.

Why native code here. Ingest finds each batch's digests in the lookup table
and places the new ones; in numpy that was rounds of calls, each over the
digests still probing, then the last few one by one in Python: a quarter of
ingest's CPU. A sharded router asks every shard about every route, and
most shards hold little of a prompt (the shared system prompt, then
nothing); in Python such a shard paid 4-8 µs a route in calls (a probe of
each page, a digest compare, a mask walk), so the CPU of all the shards per
route grew by that much per shard (docs/scale.md, "The walk compiled").
Compiled with numba, a dependency vLLM itself has, a batch's finds are one
call, and so is the walk of a prompt or of a batch of prompts.

The lookup table: open addressing with linear probing over slots that hold
row numbers (`EMPTY`, `DELETED`: a tombstone, which a probe passes and a
placement reuses). A digest's home slot is the top bits of its first 8
bytes times `GOLDEN`; a row matches a digest when its whole digest and its
length are the same (a store may hold digests of several widths, zero-padded
to the widest).

The walk computes what `PageStore.holder_ids` and `GlobalIndex._prefixes`
compute: pages looked up from the first, stopping at the first page not
indexed, a ghost (mask id 0) or the first page no worker of the walk still
holds; each worker slot's prefix is the number of pages before the first
one whose holder mask lacks the slot. Slots come out by the depth they drop
out at, then in slot order, as `_prefixes` yields them. A prompt with a page
held off the device by some worker is flagged and answered by that general
path, which counts its tiers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit

Ints = npt.NDArray[np.int64]


GOLDEN = np.uint64(0x9E3779B97F4A7C15)
"""The Fibonacci constant a digest's first 8 bytes are spread by: the top bits of the
product are its home slot in the lookup table."""


EMPTY, DELETED = -1, -2
"""What a lookup table slot holds when it holds no row: never did, or did (a tombstone)."""


@njit(cache=True, nogil=True)
def _home(shift: Any, first_word: Any) -> Any:
    """The home slot of a digest whose first 8 bytes are `first_word`: the top bits of it
    times `GOLDEN`, `shift` the 64 less the table's bits."""
    return np.int64((first_word * GOLDEN) >> shift)


@njit(cache=True, nogil=True)
def _slot(table: Any, shift: Any, digest: Any, length: Any, keys: Any, i: int, width: int) -> int:
    """Where digest `i` of `keys` (`width` bytes long) is in the table: the slot holding its
    row, or the empty slot its probe ended at (nowhere)."""
    slot_mask = table.shape[0] - 1
    pos = _home(shift, keys[i, 0])
    while True:
        r = table[pos]
        if r == EMPTY:
            return pos
        if r >= 0 and length[r] == width:
            same = True
            for w in range(digest.shape[1]):
                if digest[r, w] != keys[i, w]:
                    same = False
                    break
            if same:
                return pos
        pos = (pos + 1) & slot_mask


@njit(cache=True, nogil=True)
def find_rows(
    table: Any, shift: Any, digest: Any, length: Any, keys: Any, widths: Any, out: Any
) -> None:  # pragma: no cover - compiled; the index tests pin it
    """`out[i]`: the row of digest `i` of `keys` (zero-padded uint64 rows at least the
    store's width, `widths[i]` bytes long), or -1."""
    for i in range(len(widths)):
        out[i] = table[_slot(table, shift, digest, length, keys, i, widths[i])]


@njit(cache=True, nogil=True)
def place_rows(table: Any, shift: Any, digest: Any, rows: Any) -> int:  # pragma: no cover
    """Puts each of `rows` (distinct, their digests not in the table yet) into the first
    free slot from its home, a tombstone or an empty one; returns how many empty ones."""
    slot_mask = table.shape[0] - 1
    used = 0
    for j in range(len(rows)):
        r = rows[j]
        pos = _home(shift, digest[r, 0])
        while table[pos] >= 0:
            pos = (pos + 1) & slot_mask
        if table[pos] == EMPTY:
            used += 1
        table[pos] = r
    return used


@njit(cache=True, nogil=True)
def unplace_rows(table: Any, shift: Any, digest: Any, rows: Any) -> int:  # pragma: no cover
    """Tombstones the slot of each of `rows`; returns -1, or the index in `rows` of the
    first one not in the table (those before it are tombstoned)."""
    slot_mask = table.shape[0] - 1
    for j in range(len(rows)):
        r = rows[j]
        pos = _home(shift, digest[r, 0])
        while table[pos] != r:
            if table[pos] == EMPTY:
                return j
            pos = (pos + 1) & slot_mask
        table[pos] = DELETED
    return -1


@njit(cache=True, nogil=True)
def _emit(bits: int, byte: int, p: int, n: int, k: int, out: Any) -> int:
    """Writes (prompt `p`, slot, `n`) for each slot set in `bits` (byte `byte` of the slots)
    in column `k` of `out` on; returns the next free column."""
    for j in range(8):
        if bits >> j & 1:
            out[0, k] = p
            out[1, k] = byte * 8 + j
            out[2, k] = n
            k += 1
    return k


@njit(cache=True, nogil=True)
def _walk(
    table: Any,
    shift: Any,
    digest: Any,
    length: Any,
    holders: Any,
    present: Any,
    off_device: Any,
    keys: Any,
    ends: Any,
    out: Any,
    flagged: Any,
) -> int:  # pragma: no cover - compiled; tests/coordinator/test_index_store.py pins it
    nbytes = present.shape[1]
    width = keys.shape[1] * 8
    alive = np.zeros(nbytes, np.uint8)
    k = 0
    start = 0
    for p in range(len(ends)):
        end = ends[p]
        flagged[p] = False
        n = 0
        last = -1
        for i in range(start, end):
            row = table[_slot(table, shift, digest, length, keys, i, width)]
            if row < 0:
                break
            mid = holders[row]
            if mid == 0:  # a ghost: nobody holds it
                break
            if mid == last:  # the same holders as the page before: nobody drops out
                n += 1
                continue
            last = mid
            held = 0
            for b in range(nbytes):
                was = alive[b] if n else np.uint8(255)
                now = was & present[mid, b]
                if n:
                    k = _emit(was & ~now, b, p, n, k, out)
                alive[b] = now
                held |= now
            if not held:
                break
            if off_device[mid]:
                flagged[p] = True
            n += 1
        if n:
            for b in range(nbytes):
                k = _emit(alive[b], b, p, n, k, out)
        start = end
    return k


_warm = False


def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache, about a quarter of a second)
    for the argument types a store passes, once per process: a coordinator pays it when it
    makes its index, before it serves, not on its first report or route."""
    global _warm
    if _warm:
        return
    table = np.full(2, EMPTY, np.int32)
    shift = np.uint64(63)
    digest = np.zeros((1, 1), np.uint64)
    length = np.zeros(1, np.uint8)
    rows = np.zeros(1, np.int64)
    read_only = np.frombuffer(bytes(8), np.uint64).reshape(1, 1)  # as joined bytes give
    for keys in (read_only, np.zeros((1, 1), np.uint64)):
        find_rows(table, shift, digest, length, keys, length, rows)
    place_rows(table, shift, digest, rows)
    unplace_rows(table, shift, digest, rows)
    _walk(
        table,
        shift,
        digest,
        length,
        np.zeros(1, np.int32),
        np.zeros((1, 1), np.uint8),
        np.zeros(1, np.bool_),
        read_only,
        np.ones(1, np.int64),
        np.zeros((3, 8), np.int64),
        np.zeros(1, np.bool_),
    )
    _warm = True


class Walker:
    """`_walk` with its output buffers kept between calls (grown as needed), so a route
    allocates nothing. Not thread-safe: its store's owner serializes lookups.

    After `walk` returned k: columns [0, k) of `out`, whose rows are `prompt`,
    `slot` and `length`, are the (prompt, worker slot, prefix length) of every
    slot holding a prefix of some prompt, prompt by prompt; `flagged[p]` says
    prompt p has a page off the device.
    """

    def __init__(self) -> None:
        self._cap = 0
        self._prompts = 0
        self.out = np.empty((3, 0), np.int64)
        self.prompt, self.slot, self.length = self.out
        self.flagged = np.empty(0, np.bool_)
        self._grow(512, 16)
        warm_up()

    def _grow(self, cap: int, prompts: int) -> None:
        if cap > self._cap:
            self._cap = max(cap, 2 * self._cap)
            self.out = np.empty((3, self._cap), np.int64)
            self.prompt, self.slot, self.length = self.out
        if prompts > self._prompts:
            self._prompts = max(prompts, 2 * self._prompts)
            self.flagged = np.zeros(self._prompts, np.bool_)

    def walk(
        self,
        table: npt.NDArray[np.int32],
        shift: np.uint64,
        digest: npt.NDArray[np.uint64],
        length: npt.NDArray[np.uint8],
        holders: npt.NDArray[np.int32],
        present: npt.NDArray[np.uint8],
        off_device: npt.NDArray[np.bool_],
        keys: npt.NDArray[np.uint64],
        ends: Ints,
    ) -> int:
        """The number of columns of answers (see the class docstring). `table`: the lookup
        table (a power of two long, `shift` 64 less its bits); `digest`, `length`,
        `holders`: the store's columns; `present[mid]`: mask id mid's worker slots, a bit
        each, packed; `off_device[mid]`: whether it has a page off the device. `keys`: the
        prompts' digests end to end, a row each at the store's width, `ends` where each
        prompt ends in them."""
        prompts = len(ends)
        if prompts * present.shape[1] * 8 > self._cap or prompts > self._prompts:
            self._grow(prompts * present.shape[1] * 8, prompts)
        return int(
            _walk(
                table,
                shift,
                digest,
                length,
                holders,
                present,
                off_device,
                keys,
                ends,
                self.out,
                self.flagged,
            )
        )
