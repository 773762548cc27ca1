"""Run by .venv-engine's python: block hashes computed by vLLM's own code, for parity tests.

Reads JSON cases on stdin (algo, seed, block_size, tokens, lora, salt, mm) and
writes, per case, the hex digests vLLM's request block hasher produces. It
builds only the request fields vLLM's hasher reads; no engine starts.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from types import SimpleNamespace


def block_hashes(case: dict) -> list[str]:
    if case["seed"] is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = case["seed"]
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name(case["algo"])
    kv_cache_utils.init_none_hash(hash_fn)
    lora = case.get("lora")
    request = SimpleNamespace(
        lora_request=None if lora is None else SimpleNamespace(
            lora_name=lora[0], lora_path=lora[1], adapter_id=1, name=lora[0]
        ),
        mm_features=[
            SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=off, length=n))
            for ident, off, n in case.get("mm", [])
        ],
        cache_salt=case.get("salt"),
        prompt_embeds=None,
        all_token_ids=case["tokens"],
        num_tokens=len(case["tokens"]),
        block_hashes=[],
    )
    hasher = kv_cache_utils.get_request_block_hasher(case["block_size"], hash_fn)
    return [bytes(h).hex() for h in hasher(request)]


def main() -> None:
    importlib.import_module("vllm.v1.core.kv_cache_utils")
    cases = json.load(sys.stdin)
    json.dump([block_hashes(c) for c in cases], sys.stdout)


if __name__ == "__main__":
    main()
