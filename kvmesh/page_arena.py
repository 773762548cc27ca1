"""A store's pages in a shared-memory file that the engine beside it maps.

The kvmesh store beside a vLLM engine (`kvmesh.worker.engine_store`) keeps
its page pool, and a staging area the engine writes its saves into, in one
file under ``/dev/shm``; the engine's connector (`kvmesh.connector`) maps the
same file. A load is then a copy out of the mapping and a save a copy into
it; only small control calls (msgpack over gRPC) cross the socket::

    0         4096        pages_offset                        staging_offset (4 KiB aligned)
    ┌ header ┐┌ directory ┐┌── pool: pages x page_bytes ──────┐┌── staging: staging x page_bytes ┐
    header = b"KVMARENA" | token (16 random bytes)
    directory = one little-endian u64 per pool page: the key of the block it holds, 0 if none

The directory lets an engine find a block in its store with no call at all
(`PageDirectory`): the store writes a page's key (`page_key`, 8 bytes of
its digest) when the page is cached and clears it when the page is evicted;
an engine reads it lock-free. A stale or torn entry only names a wrong
page, which the block's seal (checked over the bytes copied, with the full
digest) refuses, so a reader never needs a lock, only a recompute now and
then.

Why a named file mapped with `mmap` (and not `multiprocessing.shared_memory`):
before Python 3.13 an attached `SharedMemory` registers with the attaching
process's resource tracker, which unlinks the segment when that process
exits, so an engine that stops would delete its store's memory; a file the
store creates, names in ``Describe`` and unlinks when it stops has one owner.
The engine maps the pool read-only (a bug there cannot write the store's
pages) and only the staging area writable.

The token proves the engine mapped this store's own file: a path on another
host or in another container, or the file of a store that has since
restarted, holds another token (or none), and `open_arena` refuses it with
`ArenaUnavailable` (the connector then moves pages over gRPC). A store
killed before it could unlink its file leaves it behind; the next store on
the host removes files whose creator is gone (`sweep_stale`): the creator
holds an exclusive `flock` on its file while it lives, which the kernel
drops when the process dies, whatever PID namespace it ran in.

Pure: os, mmap, secrets and numpy (no torch, no gRPC); importable in the
engine's venv.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.errors import ArenaUnavailable, ConfigError

SHM_DIR = "/dev/shm"
FILE_PREFIX = "kvmesh-store-"
MAGIC = b"KVMARENA"
TOKEN_BYTES = 16
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault a mapping in when it is made
HEADER_BYTES = 4096  # a page of its own: the pool's mapping starts on a page boundary
_HEADER = struct.Struct(f"<8s{TOKEN_BYTES}s")
_ALIGN = mmap.ALLOCATIONGRANULARITY
KEY_BYTES = 8


def page_key(digest: bytes) -> int:
    """A block's name in the directory: its digest's last 8 bytes, little-endian (0: none).

    A digest whose key is 0 is never found (computed instead); two digests
    sharing a key are told apart by the seal's full digest on load.
    """
    return int.from_bytes(digest[-KEY_BYTES:], "little")


class PageDirectory:
    """Which block each pool page holds, over the arena's directory region.

    The store (one writer, under its pool's lock) `put`s a page's key when
    it caches the page and `drop`s it when the page goes; an engine reads
    with `leading` and no lock. What a reader sees may be a moment old or
    torn: it names a page to try, and the block's seal decides.
    """

    def __init__(self, buffer: mmap.mmap, pages: int) -> None:
        self._keys = np.frombuffer(buffer, dtype="<u8", count=pages)

    def put(self, page: int, digest: bytes) -> None:
        self._keys[page] = page_key(digest)

    def drop(self, digest: bytes) -> None:
        """Clear every page named `digest` (a block cached twice leaves both)."""
        key = page_key(digest)
        if key:
            self._keys[self._keys == key] = 0

    def clear(self) -> None:
        self._keys[:] = 0

    def leading(self, digests: Sequence[bytes]) -> list[int]:
        """The pages of the leading `digests` held, in order, up to the first one missing.

        O(pages) per digest in numpy (a 4,096-page store: a few µs each).
        """
        keys = self._keys
        pages: list[int] = []
        for digest in digests:
            key = page_key(digest)
            found = np.flatnonzero(keys == key)
            if not key or len(found) == 0:
                break
            pages.append(int(found[0]))
        return pages

    def release(self) -> None:
        """Let go of the mapping (before the arena is unmapped)."""
        self._keys = np.zeros(0, dtype="<u8")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    """Where an arena is and how it is cut: what ``Describe`` tells the engine.

    `pages` pool pages then `staging` staging slots, each `page_bytes` long.
    """

    path: str
    token: bytes
    page_bytes: int
    pages: int
    staging: int

    @property
    def directory_offset(self) -> int:
        return HEADER_BYTES

    @property
    def directory_bytes(self) -> int:
        return self.pages * KEY_BYTES

    @property
    def pages_offset(self) -> int:
        return _aligned(HEADER_BYTES + self.directory_bytes)

    @property
    def staging_offset(self) -> int:
        return _aligned(self.pages_offset + self.pages * self.page_bytes)

    @property
    def size(self) -> int:
        return self.staging_offset + self.staging * self.page_bytes

    def wire(self) -> dict[str, Any]:
        """The layout as ``Describe``'s msgpack map."""
        return {
            "path": self.path,
            "token": self.token,
            "page_bytes": self.page_bytes,
            "pages": self.pages,
            "staging": self.staging,
        }

    @classmethod
    def from_wire(cls, body: Any) -> ArenaLayout:
        """A layout from ``Describe``; `ArenaUnavailable` when it is not one."""
        try:
            layout = cls(
                str(body["path"]),
                bytes(body["token"]),
                int(body["page_bytes"]),
                int(body["pages"]),
                int(body["staging"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArenaUnavailable(f"the store described no usable arena ({exc!r})") from None
        if (
            len(layout.token) != TOKEN_BYTES
            or min(layout.page_bytes, layout.pages, layout.staging) <= 0
        ):
            raise ArenaUnavailable(f"the store described a malformed arena: {layout}")
        return layout


class Arena:
    """A mapped arena: `pages` (the pool), `staging` and `directory`, each over its region.

    The creator (`create_arena`) owns the file and unlinks it in `close`; an
    engine (`open_arena`) only unmaps. Buffers handed out (torch or numpy
    views) keep a mapping alive until they are gone, so `close` unmaps what
    it can and leaves the rest to the views' owners.
    """

    def __init__(
        self,
        layout: ArenaLayout,
        pages: mmap.mmap,
        staging: mmap.mmap,
        directory: mmap.mmap,
        *,
        owner_fd: int = -1,
    ):
        self.layout = layout
        self.pages = pages
        self.staging = staging
        self._directory_map = directory
        self.directory = PageDirectory(directory, layout.pages)
        self._owner_fd = owner_fd  # the creator's open, flocked file: it says "alive"

    def gone(self) -> bool:
        """True once the store removed this arena's file (it stopped or restarted): what the
        directory says no longer changes, and the store's pages are elsewhere now."""
        return not os.path.exists(self.layout.path)

    @property
    def owner(self) -> bool:
        return self._owner_fd >= 0

    def close(self) -> None:
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.layout.path)
            os.close(self._owner_fd)
            self._owner_fd = -1
        self.directory.release()
        for buffer in (self.pages, self.staging, self._directory_map):
            with contextlib.suppress(BufferError):  # views still alive: unmapped when they go
                buffer.close()


def _map_directory(fd: int, layout: ArenaLayout, *, writable: bool) -> mmap.mmap:
    return mmap.mmap(
        fd,
        layout.directory_bytes,
        flags=mmap.MAP_SHARED,
        prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0),
        offset=layout.directory_offset,
    )


def _map(
    fd: int, layout: ArenaLayout, *, pages_writable: bool, populate: bool = False
) -> tuple[mmap.mmap, mmap.mmap]:
    pages_prot = mmap.PROT_READ | (mmap.PROT_WRITE if pages_writable else 0)
    pages = mmap.mmap(
        fd,
        layout.pages * layout.page_bytes,
        flags=mmap.MAP_SHARED | (MAP_POPULATE if populate else 0),
        prot=pages_prot,
        offset=layout.pages_offset,
    )
    staging = mmap.mmap(
        fd,
        layout.staging * layout.page_bytes,
        flags=mmap.MAP_SHARED,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
        offset=layout.staging_offset,
    )
    return pages, staging


def create_arena(
    page_bytes: int,
    pages: int,
    staging: int,
    directory: str | Path = SHM_DIR,
    *,
    populate: bool = True,
) -> Arena:
    """A new arena file (mode 0600) in `directory`, zeroed, header written, mapped read-write.

    `populate` (Linux) allocates and maps the whole pool now, not page by page
    as blocks first land in it: a 256 KiB block written into a fresh tmpfs
    page cost the store ~180 µs of page faults against ~9 µs for the copy
    itself (~5 ms of CPU a 25-block request, on the cores the engines run on).
    `ConfigError` when the directory cannot hold it (no such directory, no room).
    """
    if min(page_bytes, pages, staging) <= 0:
        raise ConfigError(
            "an arena needs positive page_bytes, pages and staging slots, got "
            f"{page_bytes}, {pages} and {staging}"
        )
    token = secrets.token_bytes(TOKEN_BYTES)
    path = Path(directory) / f"{FILE_PREFIX}{os.getpid()}-{token.hex()[:12]}"
    layout = ArenaLayout(str(path), token, page_bytes, pages, staging)
    # created under a name the sweep does not match, locked, then named: a sweep never
    # sees a file before its store holds the lock
    making = path.with_name(f".{path.name}")
    try:
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the store's shared-memory arena {path}: {exc}; give the store a "
            "writable --shm-dir (tmpfs) or --no-shm"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, layout.size)
        os.pwrite(fd, _HEADER.pack(MAGIC, token), 0)
        pages_map, staging_map = _map(fd, layout, pages_writable=True, populate=populate)
        directory_map = _map_directory(fd, layout, writable=True)
        os.rename(making, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(making)
        os.close(fd)
        raise ConfigError(f"cannot size the arena {path} to {layout.size} bytes: {exc}") from None
    return Arena(layout, pages_map, staging_map, directory_map, owner_fd=fd)


def open_arena(layout: ArenaLayout) -> Arena:
    """Map the arena `layout` describes (pool read-only, staging writable).

    `ArenaUnavailable` when the file is not there, not that size, or does not
    hold the layout's token: the store is on another host, in another
    container, or restarted since it described the layout.
    """
    fd = _open_checked(layout, writable=True)
    try:
        pages_map, staging_map = _map(fd, layout, pages_writable=False)
        directory_map = _map_directory(fd, layout, writable=False)
    except OSError as exc:
        raise ArenaUnavailable(f"cannot map the store's arena {layout.path}: {exc}") from None
    finally:
        os.close(fd)
    return Arena(layout, pages_map, staging_map, directory_map)


class DirectoryView:
    """Another store's directory alone, mapped read-only: which blocks that store holds (a
    peer this engine's store may pull from), without its pages."""

    def __init__(self, layout: ArenaLayout, directory: mmap.mmap) -> None:
        self.layout = layout
        self._map = directory
        self.directory = PageDirectory(directory, layout.pages)

    def gone(self) -> bool:
        return not os.path.exists(self.layout.path)

    def close(self) -> None:
        self.directory.release()
        with contextlib.suppress(BufferError):
            self._map.close()


def open_directory(layout: ArenaLayout) -> DirectoryView:
    """Map only the directory of the arena `layout` describes, read-only, after the same
    checks as `open_arena` (`ArenaUnavailable` when it is not that store's file)."""
    fd = _open_checked(layout)
    try:
        directory_map = _map_directory(fd, layout, writable=False)
    except OSError as exc:
        raise ArenaUnavailable(f"cannot map the store's arena {layout.path}: {exc}") from None
    finally:
        os.close(fd)
    return DirectoryView(layout, directory_map)


def _open_checked(layout: ArenaLayout, *, writable: bool = False) -> int:
    """An open descriptor of the arena file, checked against the layout's size and token."""
    try:
        fd = os.open(layout.path, os.O_RDWR if writable else os.O_RDONLY)
    except OSError as exc:
        raise ArenaUnavailable(f"cannot open the store's arena {layout.path}: {exc}") from None
    try:
        size = os.fstat(fd).st_size
        header = os.pread(fd, _HEADER.size, 0)
    except OSError as exc:
        os.close(fd)
        raise ArenaUnavailable(f"cannot read the store's arena {layout.path}: {exc}") from None
    if size != layout.size or header != _HEADER.pack(MAGIC, layout.token):
        os.close(fd)
        raise ArenaUnavailable(
            f"{layout.path} is not the arena the store described ({size} bytes, expected "
            f"{layout.size}, or another token): the store runs elsewhere or restarted"
        )
    return fd


def sweep_stale(directory: str | Path = SHM_DIR) -> list[Path]:
    """Remove arena files no live store holds (its creator was killed); the removed paths.

    A file whose lock can be taken has no owner left; one that cannot be
    opened (another user's) is not ours to judge and stays.
    """
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for path in Path(directory).glob(f"{FILE_PREFIX}*"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: its store is alive
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed.append(path)
            finally:
                os.close(fd)
    return removed
