"""The KV tensors of one worker: every page's K and V in one torch tensor.

Layout (one tensor per pool; page 0 is the pool's null page)::

    kv[page_id, layer, 0 = K | 1 = V, token, kv_head, head_dim]
       └─────── one page: ``page_shape`` = [layers, 2, page_size, kv_heads, head_dim]

A page is therefore one contiguous slab of ``page_nbytes`` bytes, which is
what goes on the wire: raw bytes plus dtype name, shape and an xxh3-64
checksum (`PageBlob`), never pickle. Export on a CPU store is zero-copy (a
memoryview of the slab); import writes the bytes into the slab once.

The store is a plain array: it knows nothing about hashes or reference
counts and does no locking. The page pool decides which page ids are in use;
callers must not write a page another thread reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
from torch import Tensor

from kvmesh.config import ModelConfig, PoolConfig
from kvmesh.errors import ChecksumMismatch, ConfigError, InvalidInput, PageFormatError
from kvmesh.types import PageId
from kvmesh.worker.devices import resolve_device

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
"""Registry of KV dtypes by their wire name (the name is what `PageBlob.dtype` carries)."""

_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def checksum(data: bytes | memoryview) -> int:
    """The page checksum: xxh3-64 of the raw bytes (about 10+ GB/s per core)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class PageBlob:
    """One page on the wire: raw bytes, their dtype name and shape, and a checksum.

    `data` may be a memoryview aliasing a store's tensor (see `KVStore.export_page`);
    `bytes(blob.data)` makes an owned copy.
    """

    data: bytes | memoryview
    dtype: str
    shape: tuple[int, ...]
    checksum: int

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, dtype: str, shape: Sequence[int]) -> PageBlob:
        """A blob whose checksum is computed from `data` (the sender's side)."""
        return cls(data, dtype, tuple(shape), checksum(data))


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a wire name or a dtype; `ConfigError` names the choices."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise ConfigError(f"KV dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"unknown KV dtype {dtype!r}; choose one of {sorted(DTYPES)}") from None


def _byte_view(page: Tensor) -> Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor (no copy; works for bfloat16)."""
    return page.reshape(-1).view(torch.uint8)


class KVStore:
    """Fixed-size KV page storage: ``[num_pages, layers, 2, page_size, kv_heads, head_dim]``.

    Reads and writes are indexing into one tensor. Every method that takes
    data checks it first and raises `PageFormatError` / `ChecksumMismatch` /
    `InvalidInput` before writing anything, so a refused write changes nothing.
    """

    __slots__ = ("_np_bytes", "device", "dtype", "kv", "num_pages", "page_nbytes", "page_shape")

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        memory: Tensor | None = None,
    ) -> None:
        """`memory`: bytes to keep the pages in instead of a fresh tensor (a CPU uint8
        tensor of exactly the store's size, e.g. a shared-memory arena other processes map)."""
        dims = {
            "num_pages": num_pages,
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "page_size": page_size,
        }
        bad = {k: v for k, v in dims.items() if not isinstance(v, int) or v <= 0}
        if bad:
            raise ConfigError(f"KV store dimensions must be positive integers, got {bad}")
        self.dtype = resolve_dtype(dtype)
        # "auto": cuda when this process has one; a GPU it lacks is DeviceUnavailable
        self.device = resolve_device(str(device))
        self.num_pages = num_pages
        self.page_shape: tuple[int, ...] = (num_layers, 2, page_size, num_kv_heads, head_dim)
        if memory is None:
            self.kv = torch.zeros(
                (num_pages, *self.page_shape), dtype=self.dtype, device=self.device
            )
        else:
            want = num_pages * math.prod(self.page_shape) * self.dtype.itemsize
            if memory.dtype != torch.uint8 or memory.device.type != "cpu" or memory.numel() != want:
                raise ConfigError(
                    f"a KV store's memory must be {want} CPU uint8 bytes, got {memory.numel()} "
                    f"{memory.dtype} on {memory.device}"
                )
            self.device = memory.device
            self.kv = memory.view(self.dtype).view(num_pages, *self.page_shape)
        self.page_nbytes = math.prod(self.page_shape) * self.kv.element_size()
        # A CPU store's bytes as one numpy array [num_pages, page_nbytes]: exports and
        # imports are then slicing plus at most one memcpy.
        self._np_bytes: np.ndarray | None = (
            self.kv.view(num_pages, -1).view(torch.uint8).numpy()
            if self.device.type == "cpu"
            else None
        )

    @classmethod
    def from_config(cls, model: ModelConfig, pool: PoolConfig, page_size: int) -> KVStore:
        return cls(
            pool.num_pages,
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
            page_size,
            model.dtype,
            model.device,
        )

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAMES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.page_nbytes * self.num_pages

    # -- checks ---------------------------------------------------------------

    def _check_id(self, page_id: int) -> int:
        if not 0 <= page_id < self.num_pages:
            raise InvalidInput(f"page id {page_id} is outside the KV store [0, {self.num_pages})")
        return page_id

    def _check_ids(self, page_ids: Sequence[int]) -> Tensor:
        for pid in page_ids:
            self._check_id(pid)
        return torch.as_tensor(list(page_ids), dtype=torch.long, device=self.device)

    def _check_pages(self, data: Tensor, n: int | None) -> None:
        want = self.page_shape if n is None else (n, *self.page_shape)
        if tuple(data.shape) != want or data.dtype != self.dtype:
            raise PageFormatError(
                f"page data must be {self.dtype_name} of shape {list(want)}, "
                f"got {data.dtype} of shape {list(data.shape)}"
            )

    def check_blob(self, blob: PageBlob, *, with_checksum: bool = True) -> None:
        """Raise unless `blob` is one page of this store with a matching checksum.

        Cost: one xxh3-64 pass over the bytes. Order: format before checksum,
        so a wrong-model page is reported as such, not as corruption.
        `with_checksum=False` checks the format only, for a receiver that
        hashes the bytes as they arrive.
        """
        if blob.dtype != self.dtype_name or tuple(blob.shape) != self.page_shape:
            raise PageFormatError(
                f"page is {blob.dtype} {list(blob.shape)} but this KV store holds "
                f"{self.dtype_name} {list(self.page_shape)}: sender and receiver must run "
                "the same model config"
            )
        size = memoryview(blob.data).nbytes
        if size != self.page_nbytes:
            raise PageFormatError(
                f"page has {size} bytes but {self.dtype_name} {list(self.page_shape)} "
                f"needs {self.page_nbytes}"
            )
        if not with_checksum:
            return
        actual = checksum(blob.data)
        if actual != blob.checksum:
            raise ChecksumMismatch(
                f"page bytes hash to xxh3-64 {actual:#018x}, blob claims {blob.checksum:#018x}: "
                "the page was corrupted in transit; fetch it again"
            )

    # -- tensor access ------------------------------------------------------------

    def read_page(self, page_id: PageId) -> Tensor:
        """A VIEW of one page (no copy): valid while the caller holds the page."""
        return self.kv[self._check_id(page_id)]

    def read_pages(self, page_ids: Sequence[PageId]) -> Tensor:
        """A COPY of several pages, ``[len(page_ids), *page_shape]``, in the given order."""
        return self.kv.index_select(0, self._check_ids(page_ids))

    def write_page(self, page_id: PageId, data: Tensor) -> None:
        """Copy one page's tensor (``page_shape``, store dtype, any device) into `page_id`."""
        self._check_id(page_id)
        self._check_pages(data, None)
        self.kv[page_id].copy_(data)

    def write_pages(self, page_ids: Sequence[PageId], data: Tensor) -> None:
        """Copy ``[len(page_ids), *page_shape]`` into the pages, in order."""
        index = self._check_ids(page_ids)
        self._check_pages(data, len(page_ids))
        if len(set(page_ids)) != len(page_ids):
            raise InvalidInput(f"write_pages got duplicate page ids {list(page_ids)}")
        self.kv.index_copy_(0, index, data.to(self.device))

    def copy_page(self, src: PageId, dst: PageId) -> None:
        """Copy page `src` over page `dst` (copy-on-write)."""
        self._check_id(src)
        self._check_id(dst)
        if src != dst:
            self.kv[dst].copy_(self.kv[src])

    # -- bytes ----------------------------------------------------------------

    def page_buffer(self, page_id: PageId) -> memoryview | None:
        """A writable view of one page's bytes (CPU stores), for receiving straight into it."""
        self._check_id(page_id)
        if self._np_bytes is None:
            return None
        return memoryview(self._np_bytes[page_id])

    def page_bytes(self, page_id: PageId) -> memoryview:
        """The raw bytes of one page: a zero-copy view on CPU, a host copy on GPU."""
        self._check_id(page_id)
        if self._np_bytes is not None:
            return memoryview(self._np_bytes[page_id])
        return _byte_view(self.kv[page_id]).cpu().numpy().data

    def export_page(self, page_id: PageId, *, copy: bool = False) -> PageBlob:
        """One page as a `PageBlob`.

        Without `copy`, a CPU store's blob aliases the tensor: it stays valid
        (matching its checksum) only while the page is held and not written.
        """
        data: bytes | memoryview = self.page_bytes(page_id)
        if copy:
            data = bytes(data)
        return PageBlob(data, self.dtype_name, self.page_shape, checksum(data))

    def import_page(self, page_id: PageId, blob: PageBlob, *, verified: bool = False) -> None:
        """Write `blob` into `page_id` bit-exactly after checking it (`check_blob`).

        `verified=True` skips the checks for a blob the caller has just checked.
        """
        self._check_id(page_id)
        if not verified:
            self.check_blob(blob)
        src = np.frombuffer(blob.data, dtype=np.uint8)
        if self._np_bytes is not None:
            self._np_bytes[page_id] = src
            return
        host = torch.from_numpy(src.copy())  # owned, writable: no frombuffer warning
        _byte_view(self.kv[page_id]).copy_(host.to(self.device))

    def import_pages(self, page_ids: Sequence[PageId], blobs: Sequence[PageBlob]) -> None:
        """Import several pages; all are checked before any is written."""
        if len(page_ids) != len(blobs):
            raise InvalidInput(f"import_pages got {len(page_ids)} page ids but {len(blobs)} blobs")
        for pid in page_ids:
            self._check_id(pid)
        for blob in blobs:
            self.check_blob(blob)
        for pid, blob in zip(page_ids, blobs, strict=True):
            self.import_page(pid, blob, verified=True)
