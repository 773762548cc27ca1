"""The built-in byte-level tokenizer: text <-> UTF-8 bytes as token ids 0..255.

It needs no model files and matches ``ModelConfig.vocab_size = 256``: every
token id is one byte, so any text round-trips exactly and equal texts give
equal tokens (hence equal page hashes) on every machine. Decoding model output
(arbitrary bytes) replaces invalid UTF-8 sequences instead of failing.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.errors import InvalidInput

VOCAB_SIZE = 256
"""One token per byte value."""


def encode(text: str) -> list[int]:
    """Token ids of `text`: its UTF-8 bytes. Raises `InvalidInput` for a non-str."""
    if not isinstance(text, str):
        raise InvalidInput(f"text must be a str, got {type(text).__name__}")
    return list(text.encode("utf-8"))


def decode(token_ids: Sequence[int]) -> str:
    """Text of byte token ids; invalid UTF-8 becomes U+FFFD, ids outside 0..255 are refused."""
    try:
        data = bytes(token_ids)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(
            f"byte-level token ids must be integers in [0, {VOCAB_SIZE}): {exc}"
        ) from exc
    return data.decode("utf-8", errors="replace")


class ByteTokenizer:
    """Object form of `encode` / `decode`, for code that takes a tokenizer."""

    vocab_size: int = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return decode(token_ids)
