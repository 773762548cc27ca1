"""Columnar page storage under `GlobalIndex`: compact keys, interned holder masks.

Pure (no Ray, no gRPC); numpy arrays and one roaring bitmap per worker slot.
One row per page, its "ordinal"; rows are reused once freed::

    digest   uint64[rows, words]  the page hash, zero-padded to the widest seen
    length   uint8[rows]          its length in bytes (1-64); 0 marks a free row
    holders  int32[rows]          id of the page's holder mask; 0: nobody holds it
    parent   int32[rows]          row of the page's parent, -1 for none
    kids     int32[rows]          rows whose parent is this row

Invariants, and why:

- a digest has at most one row, found through an open-addressing table of
  row numbers (int32 slots, linear probing, at most a third full, tombstones
  for deleted rows) placed by its compact key: the first 8 bytes as a uint64,
  spread by Fibonacci hashing. A slot holds only the row; the probe compares
  the row's whole digest and length, so two digests sharing their first 8
  bytes simply sit in different slots and answers are exact, never
  probabilistic. One probe touches the slot and the digest row: two cache
  lines, where a sorted array or a dict of objects touch many;
- a holder mask is the index's 4-bits-per-worker-slot int (see
  `coordinator.index`), interned: pages held by the same workers in the same
  tiers share one Python int and rows store its id, so a page costs 4 bytes
  of holders however many workers hold it (the cost moves to the number of
  distinct holder sets, small in practice because the pages of one prefix
  are held together);
- a page nobody holds any more but that is still another row's parent stays
  as a "ghost" row (holders 0, no parent of its own) so that its child can
  name its parent; it is freed with its last kid. A ghost is not indexed:
  lookups, `len`, snapshots skip it;
- each worker slot's roaring bitmap lists exactly the rows whose mask has a
  bit of that slot, so dropping a worker costs O(its pages).

Operations take whole runs of hashes (one event or consecutive events of one
worker and tier) and cost one compiled call for the lookup table's finds
and placements (`index_kernels`), a few numpy calls, and O(distinct holder
masks touched) Python steps, not a Python step per page.
The digest width is the widest digest seen (8 bytes for engine hashes, 32
for SHA-256): one 64-byte digest would widen every row.
"""

from __future__ import annotations

import array
import itertools
import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from kvmesh.coordinator.index_kernels import EMPTY as _EMPTY
from kvmesh.coordinator.index_kernels import Walker, find_rows, place_rows, unplace_rows
from kvmesh.errors import InvariantViolation
from kvmesh.types import PageHash

Rows = npt.NDArray[np.int64]

_BITS = 4
_WORKER_BITS = 0b1111
_OFF_DEVICE_BITS = 0b11101110  # of a byte of a mask: two slots' cpu, disk and other bits
_MIN_ROWS = 1024
_NO_ROWS: Rows = np.empty(0, np.int64)


def _as_rows(values: Iterable[int] | npt.NDArray[np.integer]) -> Rows:
    return np.asarray(values, dtype=np.int64)


def _distinct(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Sorted distinct values; a plain sort is several times faster than `np.unique`'s hashing
    for the few hundred values of one run."""
    if len(values) < 2:
        return values
    ordered = np.sort(values)
    keep = np.empty(len(ordered), bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def _repeats(
    digests: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint8]
) -> tuple[Rows, Rows] | None:
    """Where some of `digests` (uint64 rows, each `lengths` bytes long) repeat: the index of
    each distinct one's first appearance, in order of appearance, and for each digest which
    of those it is; None where they are all distinct.

    Sorted by their first 8 bytes, in numpy: a Python dict over a batch's hundreds of
    digests cost a shard indexing a system prompt anew a tenth of its ingest (docs/scale.md).
    Digests that share their first 8 bytes and differ after (never, from a hash; the tests
    make them) are told apart by a sort of whole rows.
    """
    keys = digests[:, 0]
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    starts = np.empty(len(keys), bool)
    starts[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    if starts.all():
        return None
    run = np.cumsum(starts) - 1  # of each sorted digest: its run of equal first words
    heads = order[starts]  # each run's first appearance: the sort is stable
    leader = heads[run]
    if (digests[order] == digests[leader]).all() and (lengths[order] == lengths[leader]).all():
        which = np.empty(len(keys), np.int64)
        which[order] = run
    else:
        whole = np.column_stack([digests, lengths.astype(np.uint64)])
        _, heads, inverse = np.unique(whole, axis=0, return_index=True, return_inverse=True)
        which = inverse.reshape(-1)
    appear = np.argsort(heads)  # the distinct digests in order of first appearance
    rank = np.empty(len(heads), np.int64)
    rank[appear] = np.arange(len(heads))
    return heads[appear], rank[which]


_HUGE_PAGES: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def _zeros(shape: int | tuple[int, int], dtype: type[np.generic]) -> npt.NDArray[Any]:
    """A zeroed array in its own anonymous memory map.

    A column or lookup table lives as long as the index and is replaced by a
    larger copy as it grows. From the heap, the freed old copies would stay
    resident (glibc raises its mmap threshold past every large block freed,
    and then serves the next columns from a heap it cannot return); a map of
    its own goes back to the OS when the array is dropped, and its pages not
    yet written are not resident at all. Huge pages where the kernel gives
    them on request, as numpy asks for its own large arrays: lookups jump
    around the columns, and 4 KiB pages cost a third of `store`'s speed in
    TLB misses.
    """
    count = int(np.prod(shape))
    size = count * np.dtype(dtype).itemsize
    if size < mmap.PAGESIZE:
        return np.zeros(shape, dtype)
    private = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _HUGE_PAGES is not None:
        private.madvise(_HUGE_PAGES)
    return np.frombuffer(private, dtype, count).reshape(shape)


def _mapped(array: npt.NDArray[Any]) -> bool:
    """Whether `array` lives in a map of its own (`_zeros`), not in Python's heap."""
    base = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer's view of the map
        base = base.obj
    return isinstance(base, mmap.mmap)


def _resized(table: npt.NDArray[Any], rows: int, columns: int) -> npt.NDArray[Any]:
    """`table` (2-d) with `rows` rows and `columns` columns, zeros where it had none."""
    out = np.zeros((rows, columns), table.dtype)
    out[: len(table), : table.shape[1]] = table
    return out


def _grown(column: npt.NDArray[Any], rows: int) -> npt.NDArray[Any]:
    """`column` with `rows` rows, its rows first and zeros after (see `_zeros`)."""
    out = _zeros((rows, *column.shape[1:]) if column.ndim == 2 else rows, column.dtype.type)
    out[: len(column)] = column
    return out


_U64 = (1 << 64) - 1
_MIN_SLOTS = 1 << 12
_LOAD_DIVISOR = 3  # slots in use (tombstones included) stay under a third


@dataclass(slots=True)
class PromptKeys:
    """Prompts' hashes as a lookup reads them, made once for every store that looks them up.

    A sharded router asks every shard about the same prompts; what a lookup
    derives from the prompts alone (their bytes end to end, a check of their
    widths) is then paid once per route, not once per shard. `width` is the
    hashes' one length when they share one (a multiple of 8, no all-zero
    digest), else 0: stores take their general path. `ends`, where each prompt
    ends in `flat`. Not frozen (a frozen init costs a route a few tenths of a
    µs), but never changed after `of`: only its caches (the walk's arrays) fill.
    """

    flat: Sequence[PageHash]
    joined: bytes
    width: int
    ends: list[int]
    _rows: npt.NDArray[np.uint64] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _ends: npt.NDArray[np.int64] | None = field(default=None, init=False, repr=False, compare=False)

    def rows(self) -> npt.NDArray[np.uint64]:
        """The digests end to end, a uint64 row of `width` bytes each, for the compiled walk
        (`PageStore.walk`); made once, shared by the shards."""
        if self._rows is None:
            self._rows = np.frombuffer(self.joined, np.uint64).reshape(-1, self.width // 8)
        return self._rows

    def ends_array(self) -> npt.NDArray[np.int64]:
        """`ends` as an array, for the compiled walk; made once."""
        if self._ends is None:
            self._ends = np.asarray(self.ends, np.int64)
        return self._ends

    @classmethod
    def of(cls, prompts: Sequence[Sequence[PageHash]]) -> PromptKeys:
        """The keys of `prompts` (one pass over their bytes)."""
        flat = prompts[0] if len(prompts) == 1 else list(itertools.chain.from_iterable(prompts))
        joined = b"".join(flat)
        width = len(flat[0]) if flat else 0
        if (
            not width
            or width % 8
            or len(joined) != width * len(flat)
            or set(map(len, flat)) != {width}
            # freed rows are zeroed: a zero digest takes the general path
            or bytes(width) in joined
        ):
            width = 0
        return cls(flat, joined, width, list(itertools.accumulate(map(len, prompts))))


class PageStore:
    """Digest -> row, with holder masks, parent links and per-slot page sets; see the module docstring.

    Not thread-safe. `masks` (id -> mask int) is public for `GlobalIndex.match`'s walk.
    """

    def __init__(self, *, min_slots: int = _MIN_SLOTS) -> None:
        self._min_slots = min_slots
        self._words = 1
        self._narrow = False  # some digest is shorter than the width: lookups compare lengths
        self._digest = np.zeros((0, 1), np.uint64)
        self._length = np.zeros(0, np.uint8)
        self._holders = np.zeros(0, np.int32)
        self._parent = np.zeros(0, np.int32)
        self._kids = np.zeros(0, np.int32)
        self._top = 0  # rows [0, top) have been used
        self._free_rows: list[int] = []
        self._slots_used = 0  # live and deleted slots
        self._new_table(min_slots)
        self.masks: list[int] = [0]
        # Per mask id, beside `masks`: which worker slots it names (a bit each, packed,
        # slot 0 first; a row per mask id, so a walk reads one cache line for it) and
        # whether it has a page off the device: what the compiled walk reads (`walk`).
        self._present = np.zeros((64, 1), np.uint8)  # [mask id, byte of slots]
        self._off_device = np.zeros(64, bool)
        self._undescribed: set[int] = set()  # mask ids whose rows of those two are not made
        self._mask_ids: dict[int, int] = {0: 0}
        self._mask_rows: list[int] = [0]  # rows per mask id; id 0 (nobody) is not counted
        self._free_mask_ids: list[int] = []
        self._held = 0
        self._slots: list[BitMap] = []
        self.walker = Walker()

    # ------------------------------------------------------------------ rows

    def _grow(self, need: int) -> None:
        cap = len(self._length)
        if need <= cap:
            return
        # Rows past the top stay untouched (and so not resident) until `_alloc` hands them out.
        new = max(need, cap + cap // 2, _MIN_ROWS)
        self._digest = _grown(self._digest, new)
        self._length = _grown(self._length, new)
        self._holders = _grown(self._holders, new)
        self._parent = _grown(self._parent, new)
        self._kids = _grown(self._kids, new)

    def _widen(self, words: int) -> None:
        if words > self._words:
            self._narrow = self._narrow or bool((self._length[: self._top] > 0).any())
            wider = _zeros((len(self._length), words), np.uint64)
            wider[:, : self._words] = self._digest
            self._digest = wider
            self._words = words

    def _alloc(self, n: int) -> Rows:
        reused = self._free_rows[-n:] if n else []
        del self._free_rows[len(self._free_rows) - len(reused) :]
        fresh = n - len(reused)
        self._grow(self._top + fresh)
        rows = np.concatenate([_as_rows(reused), np.arange(self._top, self._top + fresh)])
        self._parent[self._top : self._top + fresh] = -1  # freed rows were unlinked already
        self._top += fresh
        return rows

    def _encode(
        self, hashes: Sequence[bytes]
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint8]]:
        """Digests as zero-padded uint64 rows (at least the store's width) and their lengths."""
        n = len(hashes)
        lo, hi = min(map(len, hashes)), max(map(len, hashes))
        words = max(self._words, (hi + 7) // 8)
        if lo == hi == words * 8:
            digests = np.frombuffer(b"".join(hashes), np.uint64).reshape(n, words)
            return digests, np.full(n, hi, np.uint8)
        buf = np.zeros((n, words * 8), np.uint8)
        lengths = np.fromiter(map(len, hashes), np.uint8, n)
        for size in np.unique(lengths).tolist():
            at = np.flatnonzero(lengths == size)
            joined = b"".join([hashes[i] for i in at.tolist()])
            buf[at, :size] = np.frombuffer(joined, np.uint8).reshape(len(at), size)
        return buf.view(np.uint64), lengths

    # ------------------------------------------------------------------ lookup table

    def _new_table(self, size: int) -> None:
        bits = max(4, (size - 1).bit_length())
        self._table = _zeros(1 << bits, np.int32)
        self._table.fill(_EMPTY)
        self._table_shift = np.uint64(64 - bits)
        self._slots_used = 0

    def _make_room(self, more: int) -> None:
        """Grow (or clean tombstones out of) the table so `more` rows fit under the load."""
        if (self._slots_used + more) * _LOAD_DIVISOR <= len(self._table):
            return
        rows = self._table[self._table >= 0].astype(np.int64)
        # The next power of two past the load limit: 3-6 slots, 12-24 bytes, a page
        # (at most half full, 8-16 bytes, lookups cost a fifth more probing rounds).
        size = max(self._min_slots, (len(rows) + more) * _LOAD_DIVISOR + 1)
        self._new_table(size)
        if len(rows):
            self._place(rows)

    def _place(self, rows: Rows) -> None:
        """Put distinct rows, whose digests are not in the table yet, into free slots."""
        self._slots_used += place_rows(self._table, self._table_shift, self._digest, rows)

    def _unplace(self, rows: Rows) -> None:
        """Tombstone the slots of these rows (all in the table)."""
        if unplace_rows(self._table, self._table_shift, self._digest, rows) >= 0:
            raise InvariantViolation("a row to forget is not in the lookup table")

    def _find(self, digests: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint8]) -> Rows:
        """Each digest's row or -1 (`digests`: zero-padded rows at least the store's width,
        `lengths` their lengths)."""
        out = np.empty(len(lengths), np.int64)
        find_rows(self._table, self._table_shift, self._digest, self._length, digests, lengths, out)
        return out

    def find(self, hashes: Sequence[bytes]) -> Rows:
        """Each digest's row, or -1 where none exists (ghost rows included)."""
        if not hashes:
            return _NO_ROWS
        digests, lengths = self._encode(hashes)
        return self._find(digests, lengths)

    def _rows_for(self, hashes: Sequence[bytes]) -> tuple[Rows, Rows]:
        """Each digest's row, creating (as ghosts) the missing ones; and the positions whose
        rows were created here, the first of each where a new digest repeats (a batch's
        conversations sharing a system prompt not indexed yet)."""
        digests, lengths = self._encode(hashes)
        rows = self._find(digests, lengths)
        new = np.flatnonzero(rows < 0)
        if not len(new):
            return rows, new
        repeats = _repeats(digests[new], lengths[new])
        if repeats is None:
            first = new
            made = self._alloc(len(new))
            rows[new] = made
        else:
            heads, which = repeats
            first = new[heads]
            made = self._alloc(len(heads))
            rows[new] = made[which]
        self._widen(digests.shape[1])
        self._digest[made, : digests.shape[1]] = digests[first]
        self._length[made] = lengths[first]
        if not self._narrow and (lengths[first] != self._words * 8).any():
            self._narrow = True
        self._make_room(len(made))
        self._place(made)
        return rows, first

    def _free(self, rows: Rows) -> None:
        """Forget rows nobody holds and nobody names as parent."""
        if not len(rows):
            return
        self._unplace(rows)
        self._length[rows] = 0
        self._digest[rows] = 0
        self._free_rows.extend(rows.tolist())

    def _unlink(self, rows: Rows) -> None:
        """Rows that lost their last holder: drop their parent links, free what nobody needs."""
        parents = self._parent[rows]
        self._parent[rows] = -1
        parents = parents[parents >= 0]
        if len(parents):
            np.subtract.at(self._kids, parents, 1)
            rows = np.concatenate([rows, parents])
        self._free(self._orphaned(rows))

    def _set_parents(self, rows: Rows, parents: Rows, repeats: bool = True) -> None:
        """Point `rows` at `parents` (the last one wins for a repeated row), keeping kid counts."""
        if repeats and len(_distinct(rows)) != len(rows):
            last = len(rows) - 1 - np.unique(rows[::-1], return_index=True)[1]
            rows, parents = rows[last], parents[last]
        old = self._parent[rows]
        changed = old != parents
        if not changed.any():
            return
        rows, old, parents = rows[changed], old[changed], parents[changed]
        np.add.at(self._kids, parents[parents >= 0], 1)
        self._parent[rows] = parents
        old = old[old >= 0]
        if len(old):
            np.subtract.at(self._kids, old, 1)
            self._free(self._orphaned(old))

    def _orphaned(self, rows: Rows) -> Rows:
        """Distinct rows among `rows` that nobody holds and nobody names as parent."""
        rows = _distinct(rows)
        return rows[(self._kids[rows] == 0) & (self._holders[rows] == 0) & (self._length[rows] > 0)]

    # ------------------------------------------------------------------ masks

    def _intern(self, mask: int) -> int:
        mid = self._mask_ids.get(mask)
        if mid is None:
            if self._free_mask_ids:
                mid = self._free_mask_ids.pop()
                self.masks[mid] = mask
                self._mask_rows[mid] = 0
            else:
                mid = len(self.masks)
                self.masks.append(mask)
                self._mask_rows.append(0)
            self._mask_ids[mask] = mid
            self._undescribed.add(mid)
        return mid

    def _describe(self) -> None:
        """The rows of `_present` and `_off_device` of the masks interned since the last
        lookup, all at once: ingest churns through many short-lived masks, and describing
        each as it is made cost ingest a sixth of its time."""
        mids = sorted(self._undescribed)
        self._undescribed.clear()
        if mids[-1] >= len(self._off_device):
            rows = max(mids[-1] + 1, 2 * len(self._off_device))
            self._present = _resized(self._present, rows, self._present.shape[1])
            self._off_device = np.concatenate(
                [self._off_device, np.zeros(rows - len(self._off_device), bool)]
            )
        masks = [self.masks[mid] for mid in mids]
        size = max(1, (max(masks).bit_length() + 7) // 8)
        nibbles = np.frombuffer(
            b"".join(m.to_bytes(size, "little") for m in masks), np.uint8
        ).reshape(len(mids), size)
        slots = np.empty((len(mids), 2 * size), bool)  # two slots (nibbles) a byte, low first
        np.not_equal(nibbles & _WORKER_BITS, 0, out=slots[:, 0::2])
        np.not_equal(nibbles >> _BITS, 0, out=slots[:, 1::2])
        packed = np.packbits(slots, axis=1, bitorder="little")
        if packed.shape[1] > self._present.shape[1]:
            self._present = _resized(self._present, len(self._present), packed.shape[1])
        at = np.asarray(mids)
        self._present[at] = 0
        self._present[at, : packed.shape[1]] = packed
        self._off_device[at] = (nibbles & _OFF_DEVICE_BITS).any(axis=1)

    def _recount(self, mid: int, delta: int) -> None:
        if mid:
            n = self._mask_rows[mid] + delta
            self._mask_rows[mid] = n
            if not n:
                del self._mask_ids[self.masks[mid]]
                self._free_mask_ids.append(mid)

    def _remask(self, rows: Rows, set_bits: int, clear_bits: int, slot: int) -> Rows:
        """mask := (mask | set_bits) & ~clear_bits on distinct `rows`; returns rows left with no holder.

        Keeps per-mask row counts and `slot`'s page set (the only slot the bits touch).
        """
        ids = self._holders[rows]
        if ids.min() == ids.max():  # one holder set (pages stored together): no sort
            uniq = ids[:1]
            inverse = np.zeros(len(ids), np.int64)
            counts = np.array([len(ids)])
        else:
            uniq = _distinct(ids)
            inverse = np.searchsorted(uniq, ids)
            counts = np.bincount(inverse, minlength=len(uniq))
        mine = _WORKER_BITS << (slot * _BITS)
        keep = ~clear_bits
        new_ids = np.empty(len(uniq), np.int32)
        gained = np.zeros(len(uniq), bool)
        lost = np.zeros(len(uniq), bool)
        for i, (mid, n) in enumerate(zip(uniq.tolist(), counts.tolist(), strict=True)):
            old = self.masks[mid]
            new = (old | set_bits) & keep
            if new == old:
                new_ids[i] = mid
                continue
            nid = self._intern(new)
            self._recount(nid, n)
            self._recount(mid, -n)
            new_ids[i] = nid
            gained[i] = not old & mine and bool(new & mine)
            lost[i] = bool(old & mine) and not new & mine
            if not old:
                self._held += n
            elif not new:
                self._held -= n
        self._holders[rows] = new_ids[inverse]
        pages = self._slots[slot]
        if gained.any():
            pages |= BitMap(array.array("I", rows[gained[inverse]].astype(np.uint32).tobytes()))
        if lost.any():
            pages -= BitMap(array.array("I", rows[lost[inverse]].astype(np.uint32).tobytes()))
        return rows[new_ids[inverse] == 0]

    # ------------------------------------------------------------------ updates

    def ensure_slot(self, slot: int) -> None:
        while len(self._slots) <= slot:
            self._slots.append(BitMap())
        if slot >= 8 * self._present.shape[1]:  # a bit per slot for the walk
            self._present = _resized(self._present, len(self._present), slot // 8 + 1)

    def store(
        self, events: Sequence[tuple[Sequence[PageHash], PageHash | None]], slot: int, bit: int
    ) -> None:
        """Consecutive stored events (hashes, parent of the first) of one slot, all with tier `bit`.

        Each page's parent becomes the page before it (the event's parent for
        the first), as the events say, even for a page already indexed.
        """
        hashes: list[PageHash] = []
        starts: list[int] = []
        parent_of_first: list[PageHash] = []
        has_parent: list[bool] = []
        for hs, parent in events:
            if hs:
                starts.append(len(hashes))
                hashes.extend(hs)
                has_parent.append(parent is not None)
                if parent is not None:
                    parent_of_first.append(parent)
        if not hashes:
            return
        n = len(hashes)
        rows, created = self._rows_for([*hashes, *parent_of_first])
        rows, named = rows[:n], rows[n:]
        parents = np.empty(n, np.int64)
        parents[1:] = rows[:-1]
        if len(starts) == 1:
            parents[0] = named[0] if len(named) else -1
        else:
            first_parents = np.full(len(starts), -1, np.int64)
            first_parents[np.asarray(has_parent, bool)] = named
            parents[np.asarray(starts, np.int64)] = first_parents
        created = created[created < n]  # new pages: no holder or parent to merge with
        if len(created):
            if len(created) == n:
                self._store_fresh(rows, parents, slot, bit)
                return
            self._store_fresh(rows[created], parents[created], slot, bit)
            known = np.ones(n, bool)
            known[created] = False
            rows, parents = rows[known], parents[known]
            n = len(rows)
        distinct = _distinct(rows)
        self._remask(distinct, bit, 0, slot)
        self._set_parents(rows, parents, len(distinct) != n)
        if len(named):  # a parent named only by a page that later names another one
            self._free(self._orphaned(named))

    def _store_fresh(self, rows: Rows, parents: Rows, slot: int, bit: int) -> None:
        """`store` for distinct rows just created: every one gets mask `bit` and its parent."""
        mid = self._intern(bit)
        self._recount(mid, len(rows))
        self._held += len(rows)
        self._holders[rows] = mid
        self._slots[slot] |= BitMap(array.array("I", rows.astype(np.uint32).tobytes()))
        self._parent[rows] = parents
        np.add.at(self._kids, parents[parents >= 0], 1)

    def remove(self, hashes: Sequence[PageHash], slot: int, clear_bits: int) -> None:
        """Clear `clear_bits` (bits of `slot`) on the pages indexed among `hashes`."""
        if not hashes:
            return
        rows = self.find(hashes)
        rows = _distinct(rows[rows >= 0])
        if len(rows):
            rows = rows[self._holders[rows] != 0]
        if len(rows):
            self._unlink(self._remask(rows, 0, clear_bits, slot))

    def drop_slot(self, slot: int) -> int:
        """Clear every bit of `slot`: O(its pages). Returns how many pages it held."""
        if slot >= len(self._slots) or not self._slots[slot]:
            return 0
        rows = np.frombuffer(self._slots[slot].to_array(), np.uint32).astype(np.int64)
        self._unlink(self._remask(rows, 0, _WORKER_BITS << (slot * _BITS), slot))
        return len(rows)

    def load(
        self,
        hashes: Sequence[PageHash],
        parents: Sequence[PageHash | None],
        masks: Sequence[int],
        slots: Sequence[int],
    ) -> None:
        """Bulk insert of distinct, not yet indexed pages with their holder masks (restore)."""
        if not hashes:
            return
        n = len(hashes)
        named = [p for p in parents if p is not None]
        rows, _ = self._rows_for([*hashes, *named])
        rows, named_rows = rows[:n], rows[n:]
        parent_rows = np.full(n, -1, np.int64)
        parent_rows[np.array([p is not None for p in parents], bool)] = named_rows
        by_mask: dict[int, list[int]] = {}
        for i, m in enumerate(masks):
            by_mask.setdefault(m, []).append(i)
        for m, at in by_mask.items():
            mid = self._intern(m)
            self._recount(mid, len(at))
            these = rows[at]
            self._holders[these] = mid
            for slot in slots:
                if m >> (slot * _BITS) & _WORKER_BITS:
                    self._slots[slot] |= BitMap(array.array("I", these.astype(np.uint32).tobytes()))
        self._held += n
        self._set_parents(rows, parent_rows)
        if len(named_rows):
            self._free(self._orphaned(named_rows))

    # ------------------------------------------------------------------ reads

    def _digest_bytes(self, row: int) -> PageHash:
        return PageHash(self._digest[row].tobytes()[: self._length[row]])

    def _digests(self, rows: Rows) -> list[PageHash]:
        width = self._words * 8
        raw = self._digest[rows].tobytes()
        lengths = self._length[rows].tolist()
        return [PageHash(raw[i * width : i * width + n]) for i, n in enumerate(lengths)]

    def walk(self, keys: PromptKeys) -> int | None:
        """Every worker slot's held prefix of each of `keys`' prompts, by the compiled walk
        (`index_kernels`): how many rows of `walker`'s (prompt, slot, length) buffers now hold
        them, `walker.flagged` marking the prompts with a page off the device. None where
        the prompts take the general path (`holder_ids`): digests of several widths, or
        another width than the store's."""
        if self._narrow or keys.width != self._words * 8 or not self._top:
            return None
        if self._undescribed:
            self._describe()
        return self.walker.walk(
            self._table,
            self._table_shift,
            self._digest,
            self._length,
            self._holders,
            self._present,
            self._off_device,
            keys.rows(),
            keys.ends_array(),
        )

    def holder_ids(self, hashes: Sequence[PageHash]) -> list[int]:
        """Holder-mask ids of the pages of `hashes`, 0 for a page nobody holds or not indexed:
        the general path, where `walk` does not serve (digests of several widths) or its
        answer is not all (a page off the device: the tiers are counted from these).
        Callers stop at the first 0."""
        if not self._top or not hashes:
            return []
        found = self.find(hashes)
        ids: list[int] = np.where(found >= 0, self._holders.take(found, mode="clip"), 0).tolist()
        return ids

    def _row(self, page_hash: PageHash) -> int:
        """The row of an indexed page, or -1."""
        if type(page_hash) is not bytes or not 0 < len(page_hash) <= 64:
            return -1
        row = int(self.find([page_hash])[0])
        return row if row >= 0 and self._holders[row] else -1

    def mask(self, page_hash: PageHash) -> int:
        row = self._row(page_hash)
        return self.masks[self._holders[row]] if row >= 0 else 0

    def parent(self, page_hash: PageHash) -> PageHash | None:
        """Raises `KeyError` if nobody holds `page_hash`."""
        row = self._row(page_hash)
        if row < 0:
            raise KeyError(page_hash)
        p = int(self._parent[row])
        return None if p < 0 else self._digest_bytes(p)

    def __len__(self) -> int:
        return self._held

    def __contains__(self, page_hash: object) -> bool:
        return isinstance(page_hash, bytes) and self._row(PageHash(page_hash)) >= 0

    def _held_rows(self) -> Rows:
        return np.flatnonzero(self._holders[: self._top] != 0)

    def pages(self) -> list[PageHash]:
        return self._digests(self._held_rows())

    def slot_pages(self, slot: int) -> list[PageHash]:
        if slot >= len(self._slots):
            return []
        rows = np.frombuffer(self._slots[slot].to_array(), np.uint32).astype(np.int64)
        return self._digests(rows)

    def slot_count(self, slot: int) -> int:
        return len(self._slots[slot]) if slot < len(self._slots) else 0

    def num_entries(self) -> int:
        return sum(len(s) for s in self._slots)

    def items(self) -> list[tuple[PageHash, PageHash | None, int]]:
        """(hash, parent, mask) of every indexed page, sorted by hash."""
        rows = self._held_rows()
        hashes = self._digests(rows)
        parent_rows = self._parent[rows].astype(np.int64)
        has_parent = parent_rows >= 0
        named = iter(self._digests(parent_rows[has_parent]))
        parents: list[PageHash | None] = []
        for p in has_parent.tolist():
            parents.append(next(named) if p else None)
        masks = [self.masks[m] for m in self._holders[rows].tolist()]
        return sorted(zip(hashes, parents, masks, strict=True))

    def extra_bytes(self) -> int:
        """Bytes held outside Python's allocator, which tracemalloc cannot see: the roaring
        bitmaps, and the columns and lookup table that live in maps of their own (`_zeros`)."""
        arrays = (self._digest, self._length, self._holders, self._parent, self._kids, self._table)
        total = sum(a.nbytes for a in arrays if _mapped(a))
        for pages in self._slots:
            stats = pages.get_statistics()
            total += stats["n_bytes_array_containers"] + stats["n_bytes_run_containers"]
            total += stats["n_bytes_bitset_containers"] + 48 * stats["n_containers"]
        return total

    # ------------------------------------------------------------------ checks

    def check_invariants(self, live_slots: Sequence[int]) -> None:
        """Raise `InvariantViolation` if the columns, keys, masks or slot sets disagree. O(rows * slots)."""
        top = self._top
        used = np.flatnonzero(self._length[:top] > 0)
        free = np.flatnonzero(self._length[:top] == 0)
        if len(free) != len(self._free_rows) or set(free.tolist()) != set(self._free_rows):
            raise InvariantViolation(f"{len(free)} free rows, free list has {len(self._free_rows)}")
        found = self.find(self._digests(used))
        if not np.array_equal(found, used):
            bad = used[found != used]
            raise InvariantViolation(f"rows {bad[:5].tolist()} are not found by their own digest")
        placed = np.sort(self._table[self._table >= 0])
        if not np.array_equal(placed, used):
            raise InvariantViolation(f"{len(placed)} table slots name {len(used)} rows")
        if (self._table != _EMPTY).sum() != self._slots_used:
            raise InvariantViolation(f"{self._slots_used} slots counted as used")
        if self._slots_used * _LOAD_DIVISOR > len(self._table):
            raise InvariantViolation(
                f"{self._slots_used} of {len(self._table)} lookup slots used: past the load limit"
            )
        ids = self._holders[used]
        held = int((ids != 0).sum())
        if held != self._held:
            raise InvariantViolation(f"{held} pages have holder masks, count says {self._held}")
        if (self._holders[free] != 0).any():
            raise InvariantViolation("a free row has a holder mask")
        counts = np.bincount(ids, minlength=len(self.masks))
        for mid, mask in enumerate(self.masks):
            if (
                mid
                and mid not in self._free_mask_ids
                and (counts[mid] != self._mask_rows[mid] or self._mask_ids.get(mask) != mid)
            ):
                raise InvariantViolation(
                    f"holder mask {mid} ({mask:#x}) counts {self._mask_rows[mid]} rows, "
                    f"{counts[mid]} have it"
                )
            if mid and mid in self._free_mask_ids and counts[mid]:
                raise InvariantViolation(f"freed holder mask {mid} is still used")
        parents = self._parent[used]
        kids = np.bincount(parents[parents >= 0], minlength=top)[:top]
        if not np.array_equal(kids, self._kids[:top]):
            raise InvariantViolation("kid counts differ from the parent links")
        ghosts = used[ids == 0]
        if (self._kids[ghosts] == 0).any() or (self._parent[ghosts] >= 0).any():
            raise InvariantViolation("an unheld row is kept without being a parent")
        allowed = 0
        for slot in live_slots:
            allowed |= _WORKER_BITS << (slot * _BITS)
        for mid in set(ids.tolist()):
            if self.masks[mid] & ~allowed:
                raise InvariantViolation(f"holder mask {self.masks[mid]:#x} names a free slot")
        if self._undescribed:
            self._describe()
        for mid in set(ids.tolist()):  # what the compiled walk reads of each mask
            mask, row = self.masks[mid], self._present[mid]
            named = [s for s in range(8 * len(row)) if row[s // 8] >> (s % 8) & 1]
            if named != [s for s in range(8 * len(row)) if mask >> (s * _BITS) & _WORKER_BITS]:
                raise InvariantViolation(f"holder mask {mask:#x}: its slot bits say {named}")
            off = int.from_bytes(bytes([_OFF_DEVICE_BITS]) * (mask.bit_length() // 8 + 1), "little")
            if self._off_device[mid] != bool(mask & off):
                raise InvariantViolation(f"holder mask {mask:#x}: its off-device flag is wrong")
        for slot, pages in enumerate(self._slots):
            mine = _WORKER_BITS << (slot * _BITS)
            with_slot = [mid for mid in set(ids.tolist()) if self.masks[mid] & mine]
            want = used[np.isin(ids, with_slot)]
            have = np.frombuffer(pages.to_array(), np.uint32).astype(np.int64)
            if not np.array_equal(np.sort(want), have):
                raise InvariantViolation(
                    f"slot {slot} lists {len(have)} pages, holder masks give {len(want)}"
                )
