"""The arena's regions (header, directory, pool, staging) never overlap, in the layout or the file."""

from __future__ import annotations

import resource
from pathlib import Path

import numpy as np
import pytest

from kvmesh.page_arena import HEADER_BYTES, MAP_POPULATE, ArenaLayout, create_arena


@pytest.mark.parametrize(
    ("page_bytes", "pages", "staging"),
    [(4096, 1, 1), (8192, 600, 3), (256 * 1024, 2048, 64), (1000, 7, 5)],
)
def test_regions_follow_one_another_without_overlap(
    page_bytes: int, pages: int, staging: int
) -> None:
    layout = ArenaLayout("/dev/shm/x", b"\0" * 16, page_bytes, pages, staging)
    assert layout.directory_offset >= HEADER_BYTES
    assert layout.directory_offset + layout.directory_bytes <= layout.pages_offset
    assert layout.pages_offset + pages * page_bytes <= layout.staging_offset
    assert layout.size == layout.staging_offset + staging * page_bytes


def test_the_last_pool_page_and_the_first_staging_slot_hold_their_own_bytes(
    tmp_path: Path,
) -> None:
    # 600 directory keys push the pool past the header's page: the pool's end must
    # still come before the staging area
    arena = create_arena(8192, 600, 3, tmp_path)
    try:
        last = 599 * 8192
        arena.pages[last : last + 8192] = b"\xaa" * 8192
        arena.staging[0:8192] = b"\xbb" * 8192
        assert bytes(arena.pages[last : last + 8192]) == b"\xaa" * 8192
        assert bytes(arena.staging[0:8192]) == b"\xbb" * 8192
        arena.directory.put(599, b"\x01" * 32)
        assert arena.directory.leading([b"\x01" * 32]) == [599]
        assert bytes(arena.pages[last : last + 8192]) == b"\xaa" * 8192
    finally:
        arena.close()


def _faults_writing_every_page(populate: bool) -> int:
    """Page faults this process takes writing once into every pool page of a new arena."""
    page_bytes, pages = 64 * 1024, 64
    arena = create_arena(page_bytes, pages, 1, "/dev/shm", populate=populate)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        pool = np.frombuffer(arena.pages, dtype=np.uint8)
        pool[::4096] = 1  # one byte per 4 KiB memory page
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del pool
        return faults
    finally:
        arena.close()


@pytest.mark.skipif(not MAP_POPULATE, reason="MAP_POPULATE is Linux's")
def test_a_populated_pool_takes_no_page_fault_when_blocks_first_land_in_it() -> None:
    # the store's own CPU, on the engines' cores: a fault per 4 KiB of every fresh page
    touched = 64 * 1024 * 64 // 4096
    assert _faults_writing_every_page(populate=False) >= touched
    assert _faults_writing_every_page(populate=True) < touched // 8
