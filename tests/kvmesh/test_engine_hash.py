"""EngineHasher: vLLM's block hashes, pinned to values a real vLLM 0.32 engine published.

The vectors below came from a live engine's BlockStored events (block size 32,
default `sha256`, no PYTHONHASHSEED, ints in events); tests/engines/ checks the
rest against the engine's own code and live events.
"""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.engine_hash import (
    DEFAULT_ENGINE_SEED,
    ENGINE_HASH_ALGORITHMS,
    EngineExtraKeys,
    EngineHasher,
    MultimodalInput,
    external_to_page_hash,
)
from kvmesh.errors import ConfigError, InvalidInput

LIVE_TOKENS = list(range(5, 69))
LIVE_INT_HASHES = [5815376486845345685, 11002857776283891286]


def test_hashes_match_a_live_vllm_engines_published_ints() -> None:
    hashes = EngineHasher("sha256", 32).hash_prompt(LIVE_TOKENS)
    assert [int.from_bytes(h, "big") for h in hashes] == LIVE_INT_HASHES


def test_int_form_is_the_last_eight_bytes_of_the_digest() -> None:
    hasher = EngineHasher("sha256", 32, int_hashes=False)
    blocks = hasher.hash_blocks(LIVE_TOKENS)
    assert [len(h) for h in blocks.page_hashes] == [32, 32]
    assert [external_to_page_hash(i) for i in LIVE_INT_HASHES] == [d[-8:] for d in blocks.digests]


def test_the_first_block_chains_from_the_hash_of_the_seed() -> None:
    none = hashlib.sha256(pickle.dumps(DEFAULT_ENGINE_SEED, protocol=5)).digest()
    block = tuple(LIVE_TOKENS[:32])
    want = hashlib.sha256(pickle.dumps((none, block, None), protocol=5)).digest()
    assert EngineHasher("sha256", 32, int_hashes=False).hash_blocks(block).digests == (want,)


def test_sha256_cbor_hashes_canonical_cbor_of_the_same_values() -> None:
    none = hashlib.sha256(cbor2.dumps("s", canonical=True)).digest()
    want = hashlib.sha256(cbor2.dumps((none, (1, 2), None), canonical=True)).digest()
    assert EngineHasher("sha256_cbor", 2, seed="s").hash_blocks([1, 2, 3]).digests == (want,)


def test_only_full_blocks_are_hashed() -> None:
    hasher = EngineHasher("sha256", 4)
    assert hasher.hash_prompt([1, 2, 3]) == []
    assert len(hasher.hash_prompt(list(range(11)))) == 2


def test_a_prefix_hashes_to_a_prefix_of_the_hashes() -> None:
    hasher = EngineHasher("sha256", 4)
    long = hasher.hash_prompt(list(range(20)))
    assert hasher.hash_prompt(list(range(13))) == long[:3]


def test_each_algorithm_seed_and_form_gives_different_hashes() -> None:
    seen = set()
    for algo in ENGINE_HASH_ALGORITHMS:
        for seed in ("1", "2"):
            for ints in (True, False):
                seen.add(tuple(EngineHasher(algo, 4, seed, ints).hash_prompt(range(8))))
    assert len(seen) == len(ENGINE_HASH_ALGORITHMS) * 4


def test_no_seed_means_the_engines_default_seed() -> None:
    assert EngineHasher("sha256", 4).hash_prompt(range(4)) == EngineHasher(
        "sha256", 4, DEFAULT_ENGINE_SEED
    ).hash_prompt(range(4))


def test_xxhash_without_a_seed_is_refused_because_the_engine_seeds_it_randomly() -> None:
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        EngineHasher("xxhash", 16)
    EngineHasher("xxhash", 16, seed="7")


def test_unknown_algorithm_and_bad_block_size_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="sha256_cbor"):
        EngineHasher("md5", 16)
    with pytest.raises(ConfigError, match="block_size"):
        EngineHasher("sha256", 0)


def test_cache_salt_keys_the_first_block_only() -> None:
    salted = EngineExtraKeys(cache_salt="tenant-a")
    assert salted.for_block(0, 4) == (("cache_salt", "tenant-a"),)
    assert salted.for_block(4, 8) is None
    hasher = EngineHasher("sha256", 4)
    plain, salt_a = hasher.hash_prompt(range(8)), hasher.hash_prompt(range(8), salted)
    assert plain[0] != salt_a[0] and plain[1] != salt_a[1]  # the salt reaches later blocks by chain


def test_lora_keys_every_block_with_name_and_path() -> None:
    keys = EngineExtraKeys(lora_name="sql", lora_path="/adapters/sql")
    assert keys.for_block(8, 12) == (("lora", "sql", "/adapters/sql"),)
    with pytest.raises(InvalidInput, match="lora_path"):
        EngineExtraKeys(lora_name="sql")


def test_extra_keys_come_in_the_engines_order_lora_multimodal_salt() -> None:
    keys = EngineExtraKeys(
        lora_name="l", lora_path="p", cache_salt="s", multimodal=(MultimodalInput("img", 2, 3),)
    )
    assert keys.for_block(0, 4) == (("lora", "l", "p"), ("mm", "img", 2), ("cache_salt", "s"))


def test_a_multimodal_input_keys_each_block_it_overlaps_with_its_offset_in_the_block() -> None:
    keys = EngineExtraKeys(multimodal=(MultimodalInput("a", 2, 5), MultimodalInput("b", 7, 1)))
    assert keys.for_block(0, 4) == (("mm", "a", 2),)
    assert keys.for_block(4, 8) == (("mm", "a", -2), ("mm", "b", 3))
    assert keys.for_block(8, 12) is None


def test_overlapping_or_unsorted_multimodal_inputs_are_refused() -> None:
    with pytest.raises(InvalidInput, match="sorted"):
        EngineExtraKeys(multimodal=(MultimodalInput("a", 4, 2), MultimodalInput("b", 0, 2)))
    with pytest.raises(InvalidInput, match="sorted"):
        EngineExtraKeys(multimodal=(MultimodalInput("a", 0, 4), MultimodalInput("b", 3, 2)))


def test_non_integer_or_negative_tokens_are_refused() -> None:
    hasher = EngineHasher("sha256", 2)
    for bad in (["a", "b"], [1.5, 2], [-1, 2], [True, 1]):
        with pytest.raises(InvalidInput):
            hasher.hash_prompt(bad)  # type: ignore[arg-type]


def test_numpy_style_ints_hash_as_python_ints() -> None:
    np = pytest.importorskip("numpy")
    hasher = EngineHasher("sha256", 4)
    assert hasher.hash_prompt(np.arange(8, dtype=np.int64)) == hasher.hash_prompt(list(range(8)))


@given(st.integers(min_value=-(2**63), max_value=2**64 - 1))
def test_signed_and_unsigned_ints_of_one_value_map_to_the_same_page_hash(value: int) -> None:
    assert external_to_page_hash(value) == external_to_page_hash(value % 2**64)
    assert len(external_to_page_hash(value)) == 8


@given(st.lists(st.integers(min_value=0, max_value=2**31), max_size=40))
def test_hashing_is_deterministic_and_chained(tokens: list[int]) -> None:
    hasher = EngineHasher("sha256_cbor", 4, seed="x", int_hashes=False)
    blocks = hasher.hash_blocks(tokens)
    assert blocks == hasher.hash_blocks(list(tokens))
    assert len(blocks.digests) == len(tokens) // 4
