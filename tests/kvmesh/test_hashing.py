"""Chained page hashing: identity, chaining, extra keys, incremental extension."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.errors import ConfigError, InvalidInput
from kvmesh.hashing import (
    HASH_FUNCTIONS,
    ExtraKeys,
    MultiModalInput,
    PageHasher,
    RequestHashes,
    encode_tokens,
)

P = 4


def test_only_full_pages_are_hashed() -> None:
    h = PageHasher(P)
    assert len(h.hash_prompt(list(range(11)))) == 2
    assert len(h.hash_prompt(list(range(12)))) == 3
    assert h.hash_prompt([1, 2, 3]) == []


def test_a_page_hash_names_its_whole_prefix() -> None:
    h = PageHasher(P)
    a = h.hash_prompt([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.hash_prompt([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second page, different first page
    assert h.hash_prompt([1, 2, 3, 4, 5, 6, 7, 8, 0]) == a


def test_sha256_is_the_default_and_xxh3_is_16_bytes() -> None:
    assert PageHasher(P).digest_size == 32
    assert PageHasher(P, algo="xxh3_128").digest_size == 16
    assert set(HASH_FUNCTIONS) >= {"sha256", "xxh3_128"}


def test_different_algorithms_give_different_identities() -> None:
    toks = list(range(8))
    assert PageHasher(P).hash_prompt(toks) != PageHasher(P, algo="xxh3_128").hash_prompt(toks)


def test_cluster_seed_separates_identities_and_is_stable_across_processes() -> None:
    toks = list(range(16))
    a = PageHasher(P, seed="cluster-a").hash_prompt(toks)
    b = PageHasher(P, seed="cluster-b").hash_prompt(toks)
    assert not set(a) & set(b)
    code = (
        "from kvmesh.hashing import PageHasher;"
        "print(PageHasher(4, seed='cluster-a').hash_prompt(list(range(16)))[-1].hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == a[-1].hex()


def test_cache_salt_changes_every_page() -> None:
    h = PageHasher(P)
    toks = list(range(12))
    plain = h.hash_prompt(toks)
    salted = h.hash_prompt(toks, ExtraKeys(cache_salt="tenant-a"))
    other = h.hash_prompt(toks, ExtraKeys(cache_salt="tenant-b"))
    assert not set(plain) & set(salted)
    assert not set(salted) & set(other)


def test_lora_changes_every_page() -> None:
    h = PageHasher(P)
    toks = list(range(8))
    assert not set(h.hash_prompt(toks)) & set(h.hash_prompt(toks, ExtraKeys(lora_id=3)))
    assert h.hash_prompt(toks, ExtraKeys(lora_id=3)) == h.hash_prompt(toks, ExtraKeys(lora_id=3))


def test_multimodal_input_goes_only_into_overlapping_pages() -> None:
    h = PageHasher(P)
    toks = list(range(12))
    plain = h.hash_prompt(toks)
    image = h.hash_prompt(
        toks, ExtraKeys(mm_inputs=(MultiModalInput("img-1", offset=5, length=2),))
    )
    assert image[0] == plain[0]  # page 0 is before the image
    assert image[1] != plain[1]  # page 1 holds the image
    other = h.hash_prompt(
        toks, ExtraKeys(mm_inputs=(MultiModalInput("img-2", offset=5, length=2),))
    )
    assert other[1] != image[1]


def test_multimodal_input_rejects_empty_ranges() -> None:
    with pytest.raises(InvalidInput):
        MultiModalInput("x", offset=0, length=0)


class CountingHasher(PageHasher):
    """Counts hash calls, to prove extension hashes only new pages."""

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self.calls = 0

    def hash_page(self, parent, tokens, extra=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().hash_page(parent, tokens, extra)


def test_extending_hashes_only_newly_completed_pages() -> None:
    h = CountingHasher(P)
    req = RequestHashes(h, [1, 2, 3, 4, 5])
    assert h.calls == 1
    assert req.extend([6, 7]) == []
    assert len(req.extend([8, 9])) == 1
    assert h.calls == 2
    assert req.hashes == PageHasher(P).hash_prompt(list(range(1, 10)))


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 40))
def test_incremental_equals_one_shot_for_any_split(tokens: list[int], cut: int) -> None:
    h = PageHasher(P)
    req = RequestHashes(h, tokens[:cut])
    req.extend(tokens[cut:])
    assert req.hashes == h.hash_prompt(tokens)


def test_numpy_and_list_tokens_hash_alike() -> None:
    h = PageHasher(P)
    toks = list(range(100, 116))
    assert h.hash_prompt(np.array(toks, dtype=np.int64)) == h.hash_prompt(toks)


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0], [1.5, 0, 0, 0], ["a", 0, 0, 0]])
def test_bad_token_ids_are_rejected(bad: list[object]) -> None:
    with pytest.raises(InvalidInput):
        PageHasher(P).hash_page(None, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        encode_tokens(bad)  # type: ignore[arg-type]


def test_a_page_must_be_exactly_page_size_tokens() -> None:
    with pytest.raises(InvalidInput, match="exactly 4 tokens"):
        PageHasher(P).hash_page(None, [1, 2, 3])


def test_parent_of_the_wrong_size_is_rejected() -> None:
    with pytest.raises(InvalidInput, match="32 bytes"):
        PageHasher(P).hash_page(b"short", [1, 2, 3, 4])  # type: ignore[arg-type]


def test_unknown_algorithm_and_bad_page_size_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="xxh3_128"):
        PageHasher(P, algo="md5")
    with pytest.raises(ConfigError):
        PageHasher(0)


def test_builtin_hash_is_never_used() -> None:
    import inspect

    import kvmesh.hashing as mod

    assert " hash(" not in inspect.getsource(mod)
