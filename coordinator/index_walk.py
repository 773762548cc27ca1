"""A prompt's walk through a `PageStore`, compiled: every worker's held prefix in one call.

Why native code here. A sharded router asks every shard about every route,
and most shards hold little of a prompt (the shared system prompt, then
nothing). In Python such a shard still paid 4-8 µs a route in calls (a probe
of each page, a digest compare, a mask walk, a round of numpy calls for a
long prefix), so the CPU of all the shards per route grew by that much per
shard (docs/scale.md, "The walk compiled"). Compiled with numba, a
dependency vLLM itself has, the walk of a whole prompt is one call of about
a µs, and a batch of prompts is one call too.

What it computes is the general path's (`PageStore.holder_ids`, then
`GlobalIndex._prefixes`): pages looked up from the first by their home slots
(linear probing, whole digests compared), stopping at the first page not
indexed, a ghost (mask id 0) or the first page no worker of the walk still
holds; each worker slot's prefix is the number of pages before the first
one whose holder mask lacks the slot. Slots come out by the depth they drop
out at, then in slot order, as `_prefixes` yields them. A prompt with a page
held off the device by some worker is flagged and answered by the general
path, which counts its tiers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit

Ints = npt.NDArray[np.int64]


GOLDEN = np.uint64(0x9E3779B97F4A7C15)
"""The Fibonacci constant `PageStore` spreads a digest's first word by: the top bits of the
product are its home slot (`PromptKeys.homes`)."""


@njit(cache=True, nogil=True)
def _row(table: Any, shift: Any, digest: Any, keys: Any, i: int) -> int:
    """The row of digest `i` of `keys`, probing from its home slot (the top bits of its
    first word times `GOLDEN`, `shift` the bits below them); -1: nowhere."""
    slot_mask = table.shape[0] - 1
    pos = np.int64((keys[i, 0] * GOLDEN) >> shift)
    while True:  # linear probing; an empty slot: nowhere
        r = table[pos]
        if r == -1:
            return -1
        if r >= 0:
            same = True
            for w in range(digest.shape[1]):
                if digest[r, w] != keys[i, w]:
                    same = False
                    break
            if same:
                return int(r)
        pos = (pos + 1) & slot_mask


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
    holders: Any,
    present: Any,
    off_device: Any,
    keys: Any,
    ends: Any,
    out: Any,
    flagged: Any,
) -> int:  # pragma: no cover - compiled; tests/coordinator/test_index_store.py pins it
    nbytes = present.shape[1]
    alive = np.zeros(nbytes, np.uint8)
    k = 0
    start = 0
    for p in range(len(ends)):
        end = ends[p]
        flagged[p] = False
        n = 0
        last = -1
        for i in range(start, end):
            row = _row(table, shift, digest, keys, i)
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
    """Compile `_walk` (or load it from numba's cache, about a quarter of a second) for the
    argument types a store passes, once per process: a coordinator pays it when it makes
    its index, before it serves, not on its first route."""
    global _warm
    if _warm:
        return
    keys = np.frombuffer(bytes(8), np.uint64).reshape(1, 1)  # read-only, as `PromptKeys`'
    _walk(
        np.full(2, -1, np.int32),
        np.uint64(63),
        np.zeros((1, 1), np.uint64),
        np.zeros(1, np.int32),
        np.zeros((1, 1), np.uint8),
        np.zeros(1, np.bool_),
        keys,
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
        holders: npt.NDArray[np.int32],
        present: npt.NDArray[np.uint8],
        off_device: npt.NDArray[np.bool_],
        keys: npt.NDArray[np.uint64],
        ends: Ints,
    ) -> int:
        """The number of columns of answers (see the class docstring). `table`: the lookup
        table of rows (-1 empty, -2 deleted), a power of two long, `shift` 64 less its
        bits; `digest`, `holders`: the store's columns; `present[mid]`: mask id mid's
        worker slots, a bit each, packed; `off_device[mid]`: whether it has a page off
        the device. `keys`: the prompts' digests end to end, a row each at the store's
        width, `ends` where each prompt ends in them."""
        prompts = len(ends)
        if prompts * present.shape[1] * 8 > self._cap or prompts > self._prompts:
            self._grow(prompts * present.shape[1] * 8, prompts)
        out, flagged = self.out, self.flagged
        return int(
            _walk(table, shift, digest, holders, present, off_device, keys, ends, out, flagged)
        )
