"""A request's hashes computed elsewhere (`RequestHashes.given`), and the one reuse clamp."""

from __future__ import annotations

import pytest

from kvmesh.hashing import ExtraKeys, PageHasher, RequestHashes, reusable_pages
from kvmesh.types import PageHash

P = 4
HASHER = PageHasher(P, seed="cluster")
TOKENS = list(range(3 * P + 1))  # three full pages and one token


def test_hashes_the_sender_computed_alike_are_taken_as_they_are() -> None:
    sent = HASHER.hash_prompt(TOKENS, ExtraKeys(lora_id=2))
    got = RequestHashes.given(HASHER, TOKENS, ExtraKeys(lora_id=2), sent)
    assert got is not None
    assert got.hashes == sent and got.token_ids == TOKENS
    assert got.extend([0] * (P - 1)) == HASHER.hash_prompt(TOKENS + [0] * (P - 1), got.keys)[3:]


@pytest.mark.parametrize(
    "sent",
    [
        PageHasher(P, seed="another cluster").hash_prompt(TOKENS),  # another seed: every page
        PageHasher(P, seed="cluster", algo="xxh3_128").hash_prompt(TOKENS),  # another function
        HASHER.hash_prompt(TOKENS, ExtraKeys(cache_salt="other tenant")),
        HASHER.hash_prompt(TOKENS)[:2],  # too few
        [*HASHER.hash_prompt(TOKENS)[:2], PageHash(b"x" * 32)],  # the chain's end is wrong
    ],
)
def test_hashes_that_disagree_with_this_hasher_are_not_taken(sent: list[PageHash]) -> None:
    assert RequestHashes.given(HASHER, TOKENS, ExtraKeys(), sent) is None


def test_a_prompt_without_a_full_page_needs_no_hash() -> None:
    got = RequestHashes.given(HASHER, [1, 2], ExtraKeys(), [])
    assert got is not None and got.hashes == []


@pytest.mark.parametrize(
    ("tokens", "pages"), [(0, 0), (1, 0), (P, 0), (P + 1, 1), (2 * P, 1), (2 * P + 1, 2)]
)
def test_a_hit_never_covers_the_prompts_last_token(tokens: int, pages: int) -> None:
    assert reusable_pages(tokens, P) == pages
