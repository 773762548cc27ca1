"""Request traces in the Mooncake format, and deterministic tokens for them.

A trace line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [block ids]}``, one block id per 512-token block. Raw tokens are
not published, so a replay derives them: block id `b` at offset `i` always
gives the same token, hence equal block ids give equal tokens and equal
chained page hashes on every machine.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvmesh.errors import InvalidInput

TRACE_BLOCK_TOKENS = 512
"""Tokens per trace block id in the Mooncake release."""

_BUNDLED = "conversation_trace.jsonl.gz"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace; `hash_ids` name its prompt's blocks in order."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def bundled_trace_path() -> Path:
    """The conversation trace shipped inside the package (see data/PROVENANCE.md)."""
    return Path(str(resources.files("kvmesh") / "data" / _BUNDLED))


def _open(path: Path) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        yield from fh


def _parse(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
        ids = obj["hash_ids"]
        req = TraceRequest(
            int(obj["timestamp"]),
            int(obj["input_length"]),
            int(obj["output_length"]),
            tuple(int(b) for b in ids),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidInput(
            f"{where}: not a Mooncake trace line (need timestamp, input_length, "
            f"output_length, hash_ids): {exc}"
        ) from exc
    if req.input_length < 0 or req.output_length < 0 or any(b < 0 for b in req.hash_ids):
        raise InvalidInput(f"{where}: lengths and block ids must be non-negative")
    return req


def load_trace(path: str | Path | None = None, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace (JSONL, optionally .gz) in file order; None means the bundled one."""
    p = bundled_trace_path() if path is None else Path(path)
    if not p.is_file():
        raise InvalidInput(f"trace file {p} does not exist")
    out: list[TraceRequest] = []
    for n, line in enumerate(_open(p), 1):
        if limit is not None and len(out) >= limit:
            break
        if line.strip():
            out.append(_parse(line, f"{p}:{n}"))
    if not out:
        raise InvalidInput(f"trace file {p} holds no requests")
    return out


def blocks_tokens(
    block_ids: Iterable[int], page_size: int, vocab_size: int = 32000
) -> dict[int, list[int]]:
    """`block_tokens` for many distinct blocks at once (vectorised; one numpy pass)."""
    import numpy as np

    ids = np.fromiter(sorted(set(block_ids)), dtype=np.int64)
    # A multiplicative mix keeps neighbouring blocks' tokens unrelated; numpy's
    # int64 wrap-around keeps the low 32 bits exact.
    base = (ids * 2654435761 + 97) & 0xFFFFFFFF
    offs = np.arange(page_size, dtype=np.int64) * 40503
    toks = ((base[:, None] + offs[None, :]) ^ (base[:, None] >> 7)) % vocab_size
    return dict(zip(ids.tolist(), toks.tolist(), strict=True))


def block_tokens(block_id: int, page_size: int, vocab_size: int = 32000) -> list[int]:
    """The fixed tokens of block `block_id` (page_size of them), in [0, vocab_size)."""
    return blocks_tokens((block_id,), page_size, vocab_size)[block_id]


def request_tokens(req: TraceRequest, page_size: int, vocab_size: int = 32000) -> list[int]:
    """The request's prompt: its blocks' tokens, truncated to `input_length` when shorter."""
    out: list[int] = []
    for b in req.hash_ids:
        out.extend(block_tokens(b, page_size, vocab_size))
    if req.input_length < len(out):
        del out[max(req.input_length, 0) :]
    return out


def infinite_cache_hit_ratio(reqs: Iterable[TraceRequest]) -> float:
    """Blocks whose whole prefix was seen before / all blocks (one infinite shared cache)."""
    ids: dict[tuple[int, int], int] = {}
    hits = total = 0
    for r in reqs:
        parent = -1
        for b in r.hash_ids:
            total += 1
            key = (parent, b)
            node = ids.get(key)
            if node is None:
                node = ids[key] = len(ids)
            else:
                hits += 1
            parent = node
    return hits / total if total else 0.0
