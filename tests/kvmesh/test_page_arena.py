"""The arena's regions (header, directory, pool, staging) never overlap, in the layout or the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.page_arena import HEADER_BYTES, ArenaLayout, create_arena


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
