"""KVStore: one tensor of pages, bit-exact export/import, refusals that change nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmesh.config import ModelConfig, PoolConfig
from kvmesh.errors import ChecksumMismatch, ConfigError, InvalidInput, PageFormatError
from kvmesh.types import PageId
from kvmesh.worker.kv_store import DTYPES, KVStore, PageBlob, checksum

DTYPE_NAMES = ["float32", "float16", "bfloat16"]


def make_store(dtype: str = "float32", num_pages: int = 8, seed: int = 0) -> KVStore:
    store = KVStore(num_pages, num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    store.kv.copy_(torch.randn(store.kv.shape, generator=gen).to(store.dtype))
    return store


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so NaN payloads and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_store_is_one_tensor_with_the_page_axis_first() -> None:
    store = KVStore(5, num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
    assert tuple(store.kv.shape) == (5, 3, 2, 4, 2, 8)
    assert store.page_shape == (3, 2, 4, 2, 8)
    assert store.page_nbytes == 3 * 2 * 4 * 2 * 8 * 2
    assert store.dtype_name == "float16"


def test_from_config_takes_shapes_from_the_model_and_pages_from_the_pool() -> None:
    model = ModelConfig(num_layers=3, num_kv_heads=4, head_dim=8, dtype="bfloat16")
    store = KVStore.from_config(model, PoolConfig(num_pages=6), page_size=16)
    assert tuple(store.kv.shape) == (6, 3, 2, 16, 4, 8)
    assert store.kv.dtype == torch.bfloat16


def test_unknown_dtype_and_bad_dimensions_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown KV dtype"):
        KVStore(4, 1, 1, 1, 1, dtype="float12")
    with pytest.raises(ConfigError, match="positive"):
        KVStore(0, 1, 1, 1, 1)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_export_then_import_is_bit_exact(dtype: str) -> None:
    src = make_store(dtype)
    dst = make_store(dtype, seed=1)
    for page in range(src.num_pages):
        dst.import_page(PageId(page), src.export_page(PageId(page)))
    assert torch.equal(bits(dst.kv), bits(src.kv))


def test_special_float_values_survive_the_round_trip() -> None:
    src = make_store("bfloat16")
    src.kv[2].view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    dst = make_store("bfloat16", seed=3)
    dst.import_page(PageId(6), src.export_page(PageId(2)))
    assert torch.equal(bits(dst.kv[6]), bits(src.kv[2]))


def test_export_without_copy_aliases_the_tensor_and_with_copy_does_not() -> None:
    store = make_store()
    view = store.export_page(PageId(1))
    owned = store.export_page(PageId(1), copy=True)
    store.kv[1].fill_(7.0)
    assert bytes(view.data) == bytes(store.page_bytes(PageId(1)))
    assert bytes(owned.data) != bytes(view.data)
    assert checksum(owned.data) == owned.checksum


def test_blob_checksum_is_xxh3_64_of_the_bytes() -> None:
    import xxhash

    blob = make_store().export_page(PageId(3))
    assert blob.checksum == xxhash.xxh3_64_intdigest(bytes(blob.data))
    assert blob.nbytes == make_store().page_nbytes


def _rejected(store: KVStore, blob: PageBlob, error: type[Exception], match: str) -> None:
    before = store.kv.clone()
    with pytest.raises(error, match=match):
        store.import_page(PageId(4), blob)
    assert torch.equal(bits(store.kv), bits(before))


def test_corrupted_bytes_are_a_checksum_mismatch_and_write_nothing() -> None:
    store = make_store()
    blob = make_store(seed=9).export_page(PageId(2), copy=True)
    flipped = bytearray(blob.data)
    flipped[17] ^= 0x01
    _rejected(store, dataclasses.replace(blob, data=bytes(flipped)), ChecksumMismatch, "corrupted")


def test_wrong_size_shape_or_dtype_is_a_format_error_and_writes_nothing() -> None:
    store = make_store()
    blob = make_store(seed=9).export_page(PageId(2), copy=True)
    short = bytes(blob.data)[:-2]
    _rejected(store, PageBlob.from_bytes(short, blob.dtype, blob.shape), PageFormatError, "bytes")
    _rejected(store, dataclasses.replace(blob, shape=(1, 2, 3)), PageFormatError, "same model")
    _rejected(store, dataclasses.replace(blob, dtype="float16"), PageFormatError, "same model")
    half = make_store("float16").export_page(PageId(1))
    _rejected(store, half, PageFormatError, "float16")


def test_page_ids_outside_the_store_are_refused() -> None:
    store = make_store()
    with pytest.raises(InvalidInput, match="outside"):
        store.read_page(PageId(8))
    with pytest.raises(InvalidInput, match="outside"):
        store.import_page(PageId(-1), store.export_page(PageId(1)))


def test_read_page_is_a_view_and_read_pages_a_copy_in_order() -> None:
    store = make_store()
    many = store.read_pages([PageId(3), PageId(1)])
    assert torch.equal(many[0], store.kv[3]) and torch.equal(many[1], store.kv[1])
    store.read_page(PageId(3)).zero_()
    assert not torch.equal(many[0], store.kv[3])
    assert torch.count_nonzero(store.kv[3]) == 0


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_write_pages_places_each_page_at_its_index(dtype: str) -> None:
    store = make_store(dtype)
    data = make_store(dtype, seed=5).kv[:3].clone()
    store.write_pages([PageId(6), PageId(2), PageId(4)], data)
    for i, pid in enumerate([6, 2, 4]):
        assert torch.equal(bits(store.kv[pid]), bits(data[i]))


def test_write_page_refuses_a_wrong_shape_or_dtype() -> None:
    store = make_store()
    before = store.kv.clone()
    with pytest.raises(PageFormatError):
        store.write_page(PageId(1), torch.zeros(store.page_shape, dtype=torch.float16))
    with pytest.raises(PageFormatError):
        store.write_page(PageId(1), torch.zeros((1, *store.page_shape)))
    with pytest.raises(InvalidInput, match="duplicate"):
        store.write_pages([PageId(1), PageId(1)], torch.zeros((2, *store.page_shape)))
    assert torch.equal(store.kv, before)


def test_copy_page_duplicates_one_page_exactly() -> None:
    store = make_store("bfloat16")
    store.copy_page(PageId(2), PageId(5))
    assert torch.equal(bits(store.kv[5]), bits(store.kv[2]))
    assert not torch.equal(store.kv[5], store.kv[6])


def test_import_pages_checks_every_blob_before_writing_any() -> None:
    store = make_store()
    src = make_store(seed=4)
    good = src.export_page(PageId(1), copy=True)
    bad = dataclasses.replace(src.export_page(PageId(2), copy=True), checksum=1)
    before = store.kv.clone()
    with pytest.raises(ChecksumMismatch):
        store.import_pages([PageId(3), PageId(4)], [good, bad])
    assert torch.equal(store.kv, before)
    store.import_pages([PageId(3)], [good])
    assert torch.equal(store.kv[3], src.kv[1])


def test_every_registered_dtype_round_trips() -> None:
    for name in DTYPES:
        src = KVStore(3, 1, 1, 4, 2, dtype=name)
        src.kv.view(torch.uint8).copy_(
            torch.randint(0, 256, src.kv.view(torch.uint8).shape, dtype=torch.uint8)
        )
        dst = KVStore(3, 1, 1, 4, 2, dtype=name)
        dst.import_page(PageId(1), src.export_page(PageId(2)))
        assert torch.equal(bits(dst.kv[1]), bits(src.kv[2])), name
