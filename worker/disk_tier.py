"""The disk tier: pages the host tier evicted, one file each, within a byte budget.

A page file ``<hash hex>.kvp`` is raw bytes behind a checked header::

    b"KVMPAGE1"  u32 LE header length  header (msgpack map)  u64 LE xxh3-64(header)  page bytes
    header = {hash, parent, lora, tenant, dtype, shape, nbytes, checksum (xxh3-64 of the bytes)}

Never pickle: a file is read as bytes and checked field by field. Writes are
crash-safe: the file is written under a temporary name in the same folder,
fsynced (`fsync`, on by default), renamed over its final name (atomic) and the
folder fsynced, so a crash leaves either the whole page or a stray temp file,
which the next start deletes. A page whose header, size or checksum is wrong
is detected when it is read (or adopted), deleted, counted
(``kvmesh_disk_pages_dropped_total``) and never served: `take` raises
`DiskPageCorrupt`.

The tier keeps ``hash -> entry`` in LRU order (and each tenant's entries in
their own queue, for fair eviction) and evicts (its `EvictionPolicy`)
until a new page fits `budget_bytes`. A restarted worker re-adopts the files
its folder holds (headers checked, bytes checked when read), oldest first by
modification time. Not thread-safe; emits no events (`TieredCache` does).
"""

from __future__ import annotations

import math
import os
import struct
import uuid
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from kvmesh.errors import ConfigError, DiskPageCorrupt, InvalidInput, InvariantViolation
from kvmesh.metrics import DISK_PAGES_DROPPED
from kvmesh.types import PageHash
from kvmesh.worker.kv_store import PageBlob, checksum, resolve_dtype
from kvmesh.worker.page_pool import PageMeta
from kvmesh.worker.tenant_share import (
    EvictionPolicy,
    LruEviction,
    QueuedCandidates,
    TenantQueues,
)

MAGIC = b"KVMPAGE1"
SUFFIX = ".kvp"
_TMP_MARK = ".tmp-"
_LEN = struct.Struct("<I")
_SUM = struct.Struct("<Q")
_PREFIX = len(MAGIC) + _LEN.size
MAX_HEADER_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class DiskEntry:
    meta: PageMeta
    nbytes: int  # the whole file


def encode_page_file(meta: PageMeta, blob: PageBlob) -> tuple[bytes, bytes]:
    """The file's head (magic, header, header checksum) and its data, to be written in order."""
    header = msgpack.packb(
        {
            "hash": bytes(meta.page_hash),
            "parent": None if meta.parent_hash is None else bytes(meta.parent_hash),
            "lora": meta.lora_id,
            "tenant": meta.tenant,
            "dtype": blob.dtype,
            "shape": list(blob.shape),
            "nbytes": blob.nbytes,
            "checksum": blob.checksum,
        },
        use_bin_type=True,
    )
    head = b"".join(
        (MAGIC, _LEN.pack(len(header)), header, _SUM.pack(xxhash.xxh3_64_intdigest(header)))
    )
    return head, bytes(blob.data) if isinstance(blob.data, memoryview) else blob.data


@dataclass(frozen=True, slots=True)
class _Header:
    meta: PageMeta
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int
    data_offset: int


def _opt_bytes(value: Any) -> PageHash | None:
    if value is None:
        return None
    if isinstance(value, bytes) and 0 < len(value) <= 64:
        return PageHash(value)
    raise ValueError("parent must be 1-64 bytes or nil")


def _parse_header(head: bytes, name: str) -> _Header:
    """Parse and check a file's head; `ValueError` says what is wrong."""
    if len(head) < _PREFIX or head[: len(MAGIC)] != MAGIC:
        raise ValueError("no page-file magic")
    (hlen,) = _LEN.unpack_from(head, len(MAGIC))
    if hlen > MAX_HEADER_BYTES:
        raise ValueError(f"header length {hlen} exceeds {MAX_HEADER_BYTES}")
    end = _PREFIX + hlen + _SUM.size
    if len(head) < end:
        raise EOFError("file ends inside its header")
    raw = head[_PREFIX : _PREFIX + hlen]
    (want,) = _SUM.unpack_from(head, _PREFIX + hlen)
    if xxhash.xxh3_64_intdigest(raw) != want:
        raise ValueError("header checksum mismatch")
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for malformed input
        raise ValueError(f"header is not msgpack: {exc}") from exc
    if not isinstance(h, dict):
        raise ValueError("header is not a map")
    page_hash = h.get("hash")
    if not isinstance(page_hash, bytes) or page_hash.hex() + SUFFIX != name:
        raise ValueError("header hash does not match the file name")
    lora, tenant, dtype, shape = h.get("lora"), h.get("tenant"), h.get("dtype"), h.get("shape")
    nbytes, csum = h.get("nbytes"), h.get("checksum")
    if lora is not None and (not isinstance(lora, int) or isinstance(lora, bool)):
        raise ValueError("lora must be an int or nil")
    if not isinstance(tenant, str) or not isinstance(dtype, str):
        raise ValueError("tenant and dtype must be strings")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError("shape must be a list of positive ints")
    if not isinstance(nbytes, int) or nbytes < 0 or not isinstance(csum, int):
        raise ValueError("nbytes and checksum must be ints")
    meta = PageMeta(PageHash(page_hash), _opt_bytes(h.get("parent")), lora, tenant)
    return _Header(meta, dtype, tuple(shape), nbytes, csum, end)


class DiskTier:
    """Page files in one folder, LRU (or fair-share) within a byte budget.

    Costs: `put` one file write (+ fsyncs) and an unlink per evicted page; `take`
    one file read, one checksum pass and an unlink.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        budget_bytes: int,
        *,
        dtype: str,
        page_shape: Sequence[int],
        fsync: bool = True,
        policy: EvictionPolicy | None = None,
        adopt: bool = True,
        worker: str = "worker",
    ) -> None:
        self.directory = Path(directory)
        self.dtype = dtype
        self.page_shape = tuple(page_shape)
        self.fsync = fsync
        self.policy: EvictionPolicy = policy or LruEviction()
        self.worker = worker
        self._entries: OrderedDict[PageHash, DiskEntry] = OrderedDict()
        self._queues: TenantQueues[PageHash] = TenantQueues()
        self.tenant_pages: Counter[str] = Counter()
        self.used_bytes = 0
        # a page file's size, its header's variable fields at their widest (64-byte hashes)
        page_bytes = math.prod(self.page_shape) * resolve_dtype(dtype).itemsize
        widest = PageMeta(
            PageHash(b"\xff" * 64), PageHash(b"\xff" * 64), 2**63 - 1, "t-" + "f" * 12
        )
        blob = PageBlob(b"", dtype, self.page_shape, 2**64 - 1)
        self.page_file_bytes = len(encode_page_file(widest, blob)[0]) + page_bytes + 8
        if budget_bytes < self.page_file_bytes:
            raise ConfigError(
                f"disk_bytes={budget_bytes} cannot hold one page file (about "
                f"{self.page_file_bytes} bytes for {dtype} {list(self.page_shape)}); raise it"
            )
        self.budget_bytes = budget_bytes
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f"{_TMP_MARK}probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"disk_dir {str(self.directory)!r} is not a writable folder: {exc}"
            ) from exc
        self.adopted: list[PageMeta] = self._adopt() if adopt else self._wipe()

    # ---------------------------------------------------------------- lookups

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, page_hash: object) -> bool:
        return page_hash in self._entries

    def entries(self) -> Iterator[DiskEntry]:
        """Entries oldest first (the next to be evicted first)."""
        return iter(self._entries.values())

    def get(self, page_hash: PageHash) -> DiskEntry | None:
        return self._entries.get(page_hash)

    def path_of(self, page_hash: PageHash) -> Path:
        return self.directory / (page_hash.hex() + SUFFIX)

    # ---------------------------------------------------------------- writing

    def put(self, meta: PageMeta, blob: PageBlob) -> list[PageMeta]:
        """Write one page crash-safe; returns the pages evicted (deleted) to fit the budget.

        A hash already held is refreshed, not written again. Raises `InvalidInput`
        for a page of another dtype or shape than the tier's.
        """
        if blob.dtype != self.dtype or tuple(blob.shape) != self.page_shape:
            raise InvalidInput(
                f"disk tier holds {self.dtype} {list(self.page_shape)} pages, got "
                f"{blob.dtype} {list(blob.shape)}"
            )
        if meta.page_hash in self._entries:
            self._refresh(meta.page_hash)
            return []
        head, data = encode_page_file(meta, blob)
        size = len(head) + len(data)
        evicted = self._make_room(size, meta.tenant)
        self._write(self.path_of(meta.page_hash), head, data)
        return evicted + self.admit(meta, size)

    def write(self, meta: PageMeta, blob: PageBlob) -> int:
        """Only the file of `put` (crash-safe), touching no state, so that a background
        writer can run it without the owner's lock; `admit` it then. Returns its size."""
        if blob.dtype != self.dtype or tuple(blob.shape) != self.page_shape:
            raise InvalidInput(
                f"disk tier holds {self.dtype} {list(self.page_shape)} pages, got "
                f"{blob.dtype} {list(blob.shape)}"
            )
        head, data = encode_page_file(meta, blob)
        self._write(self.path_of(meta.page_hash), head, data)
        return len(head) + len(data)

    def admit(self, meta: PageMeta, size: int) -> list[PageMeta]:
        """Hold a page whose file `write` made; returns the pages evicted to fit the budget."""
        if meta.page_hash in self._entries:  # written twice: the file was replaced whole
            self._refresh(meta.page_hash)
            return []
        self._hold(DiskEntry(meta, size))
        self.used_bytes += size
        if self.used_bytes <= self.budget_bytes:
            return []
        return self._make_room(0, meta.tenant, keep=meta.page_hash)  # never its own victim

    def _make_room(self, size: int, tenant: str, keep: PageHash | None = None) -> list[PageMeta]:
        evicted: list[PageMeta] = []
        capacity = max(1, self.budget_bytes // self.page_file_bytes)
        while self.used_bytes + size > self.budget_bytes and len(self._entries) > (
            keep is not None
        ):
            (victim,) = self.policy.choose(
                QueuedCandidates(self._entries.__iter__, self._queues, keep),
                self.tenant_pages,
                capacity,
                1,
                tenant,
            )
            evicted.append(self._drop(victim))
        return evicted

    def _hold(self, entry: DiskEntry) -> None:
        """Hold a new entry as the most recently used (its bytes counted by the caller)."""
        key, tenant = entry.meta.page_hash, entry.meta.tenant
        self._entries[key] = entry
        self._queues.push(key, tenant)
        self.tenant_pages[tenant] += 1

    def _refresh(self, page_hash: PageHash) -> None:
        self._entries.move_to_end(page_hash)
        self._queues.push(page_hash, self._entries[page_hash].meta.tenant)

    def _write(self, path: Path, head: bytes, data: bytes) -> None:
        tmp = path.with_name(f"{_TMP_MARK}{path.name}-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if self.fsync:
                fd = os.open(self.directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # ---------------------------------------------------------------- reading

    def take(self, page_hash: PageHash) -> tuple[PageMeta, PageBlob] | None:
        """Read one page and delete its file (it moves up a tier); None when not held.

        A file that is missing, truncated or does not match its checksums is deleted
        and counted, and `DiskPageCorrupt` raised: its bytes are never returned.
        """
        if page_hash not in self._entries:
            return None
        try:
            got = self.read(page_hash)
        except DiskPageCorrupt as exc:
            self.drop_bad(page_hash, exc.reason)
            raise
        self._drop(page_hash)
        return got

    def read(self, page_hash: PageHash) -> tuple[PageMeta, PageBlob]:
        """Read and check one page file, changing nothing (a background reader may call it
        without the owner's lock). Raises `DiskPageCorrupt` for a missing, truncated or
        corrupted file; the owner then deletes it (`drop_bad`)."""
        path = self.path_of(page_hash)
        try:
            raw = path.read_bytes()
            header = _parse_header(raw, path.name)
            self._check_format(header)
            data = raw[header.data_offset :]
            if len(data) != header.nbytes:
                raise EOFError(f"{len(data)} of {header.nbytes} page bytes")
            if checksum(data) != header.checksum:
                raise ValueError("page bytes do not match their checksum")
        except (OSError, ValueError, EOFError) as exc:
            reason = "truncated" if isinstance(exc, EOFError) else "corrupt"
            raise DiskPageCorrupt(
                f"disk page {page_hash.hex()[:16]} in {str(self.directory)!r} is {reason} "
                f"({exc}); it is deleted and will be recomputed",
                reason,
            ) from exc
        return header.meta, PageBlob(data, header.dtype, header.shape, header.checksum)

    def drop_bad(self, page_hash: PageHash, reason: str) -> PageMeta | None:
        """Delete a page file found bad and count it; its meta, or None if not held."""
        DISK_PAGES_DROPPED.labels(self.worker, reason).inc()
        if page_hash not in self._entries:
            return None
        return self._drop(page_hash)

    def _check_format(self, header: _Header) -> None:
        if header.dtype != self.dtype or header.shape != self.page_shape:
            raise ValueError(
                f"page is {header.dtype} {list(header.shape)}, the tier holds "
                f"{self.dtype} {list(self.page_shape)}"
            )

    def discard(self, page_hashes: Sequence[PageHash]) -> list[PageMeta]:
        """Delete the files of the hashes held; returns their metadata."""
        return [self._drop(h) for h in page_hashes if h in self._entries]

    def clear(self) -> list[PageMeta]:
        return self.discard(list(self._entries))

    def _drop(self, page_hash: PageHash) -> PageMeta:
        entry = self._entries.pop(page_hash)
        self.path_of(page_hash).unlink(missing_ok=True)
        self.used_bytes -= entry.nbytes
        tenant = entry.meta.tenant
        self._queues.remove(page_hash, tenant)
        self.tenant_pages[tenant] -= 1
        if not self.tenant_pages[tenant]:
            del self.tenant_pages[tenant]
        return entry.meta

    # ---------------------------------------------------------------- start

    def _adopt(self) -> list[PageMeta]:
        """Take over the page files the folder holds (a restart); drop the bad ones."""
        found: list[tuple[float, str, DiskEntry]] = []
        for path in self.directory.iterdir():
            name = path.name
            if name.startswith(_TMP_MARK):
                path.unlink(missing_ok=True)
                DISK_PAGES_DROPPED.labels(self.worker, "stray").inc()
                continue
            if not name.endswith(SUFFIX) or not path.is_file():
                continue
            try:
                stat = path.stat()
                with open(path, "rb") as f:
                    head = f.read(_PREFIX + MAX_HEADER_BYTES + _SUM.size)
                header = _parse_header(head, name)
            except (OSError, ValueError, EOFError) as exc:
                path.unlink(missing_ok=True)
                DISK_PAGES_DROPPED.labels(
                    self.worker, "truncated" if isinstance(exc, EOFError) else "corrupt"
                ).inc()
                continue
            try:
                self._check_format(header)
            except ValueError:
                path.unlink(missing_ok=True)
                DISK_PAGES_DROPPED.labels(self.worker, "format").inc()
                continue
            if stat.st_size != header.data_offset + header.nbytes:
                path.unlink(missing_ok=True)
                DISK_PAGES_DROPPED.labels(self.worker, "truncated").inc()
                continue
            found.append((stat.st_mtime, name, DiskEntry(header.meta, stat.st_size)))
        found.sort(key=lambda item: (item[0], item[1]))
        for _, _, entry in found:
            self._hold(entry)
            self.used_bytes += entry.nbytes
        while self.used_bytes > self.budget_bytes and self._entries:
            self._drop(next(iter(self._entries)))
        return [e.meta for e in self._entries.values()]

    def _wipe(self) -> list[PageMeta]:
        """Delete what an earlier run left (adopt=False): its pages are not announced."""
        for path in self.directory.iterdir():
            if path.name.endswith(SUFFIX) or path.name.startswith(_TMP_MARK):
                path.unlink(missing_ok=True)
        return []

    def check_invariants(self, in_flight: Iterable[PageHash] = ()) -> None:
        """Raise `InvariantViolation` unless entries, files, bytes and tenant counts agree.

        `in_flight`: hashes a background writer may have written but not admitted yet.
        """
        files = {p.name for p in self.directory.iterdir() if p.name.endswith(SUFFIX)}
        files -= {h.hex() + SUFFIX for h in in_flight if h not in self._entries}
        names = {h.hex() + SUFFIX for h in self._entries}
        if files != names:
            raise InvariantViolation(
                f"disk tier files and entries differ: {sorted(files ^ names)[:4]}"
            )
        used = sum(e.nbytes for e in self._entries.values())
        if used != self.used_bytes or used > self.budget_bytes:
            raise InvariantViolation(
                f"disk tier counts {self.used_bytes} bytes, files hold {used}, budget "
                f"{self.budget_bytes}"
            )
        counts = Counter(e.meta.tenant for e in self._entries.values())
        if counts != self.tenant_pages:
            raise InvariantViolation(
                f"disk tier tenant counts {dict(self.tenant_pages)} != {counts}"
            )
        by_tenant: dict[str | None, list[PageHash]] = {}
        for h, e in self._entries.items():
            by_tenant.setdefault(e.meta.tenant, []).append(h)
        if self._queues.as_lists() != by_tenant:
            raise InvariantViolation(
                "disk tier tenant queues are not its entries per tenant in LRU order"
            )
