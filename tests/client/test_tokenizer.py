"""The byte-level tokenizer: exact round trips, the model's vocabulary, clear refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.client import tokenizer
from kvmesh.config import ModelConfig
from kvmesh.errors import InvalidInput


def test_ascii_text_maps_to_its_byte_values() -> None:
    assert tokenizer.encode("Hi!") == [72, 105, 33]


def test_multibyte_characters_become_their_utf8_bytes() -> None:
    assert tokenizer.encode("é") == [0xC3, 0xA9]


@given(st.text())
def test_any_text_round_trips_exactly(text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


@given(st.text())
def test_every_token_lies_in_the_model_vocabulary(text: str) -> None:
    assert all(0 <= t < ModelConfig().vocab_size for t in tokenizer.encode(text))


def test_vocabulary_size_matches_the_model_config() -> None:
    assert tokenizer.VOCAB_SIZE == ModelConfig().vocab_size == tokenizer.ByteTokenizer.vocab_size


def test_invalid_utf8_from_the_model_decodes_with_replacement_characters() -> None:
    assert tokenizer.decode([0xFF, 65]) == "\ufffdA"


def test_ids_outside_a_byte_are_refused_with_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="0, 256"):
        tokenizer.decode([300])


def test_non_text_input_is_refused_with_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="str"):
        tokenizer.encode(b"bytes")  # type: ignore[arg-type]
