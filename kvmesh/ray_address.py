"""Where a running Ray cluster is, and whether it answers, found out in seconds.

`ray.init(address=...)` with nothing listening retries the GCS for minutes
(Ray's own reconnect budget), printing every retry. A caller that joins a
cluster asks `reachable` first: a TCP connect to the GCS port with a bounded
timeout (the setting `ClusterConfig.connect_timeout_s`, ``KVMESH_CONNECT_TIMEOUT_S``,
5 s by default), so "nothing runs there" is one `ClusterUnreachable` line
within it, and Ray is never asked to wait.

Addresses: ``HOST:PORT`` (the GCS), ``ray://HOST:PORT`` (Ray client),
``auto`` (the cluster `ray start` last started on this machine, as Ray finds it).
Each error names where the address came from (``--address``, ``RAY_ADDRESS``...).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from kvmesh.errors import ClusterUnreachable, ConfigError

RAY_ADDRESS_VARIABLE = "RAY_ADDRESS"


def address_from_environment(env: Mapping[str, str] | None = None) -> str | None:
    """``RAY_ADDRESS`` when set and not empty (Ray's own messages tell users to set it)."""
    value = (os.environ if env is None else env).get(RAY_ADDRESS_VARIABLE, "").strip()
    return value or None


def split_address(address: str, source: str) -> tuple[str, int]:
    """(host, port) of ``HOST:PORT``, ``[IPv6]:PORT`` or ``ray://HOST:PORT``; refuses others."""
    rest = address.removeprefix("ray://")
    host, colon, port = rest.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(
            f"{source}={address!r}: a Ray address is HOST:PORT (e.g. 127.0.0.1:6379), "
            "ray://HOST:PORT or 'auto'"
        )
    return host, int(port)


def _resolve_auto(source: str) -> str:
    # Ray's own lookup of 'auto' (the file `ray start` writes in its temp dir, then any
    # running GCS process on this machine); it has no public API.
    from ray._private.services import canonicalize_bootstrap_address

    try:
        found = canonicalize_bootstrap_address("auto")
    except (ConnectionError, ValueError) as exc:
        raise ClusterUnreachable(
            f"{source}='auto' found no Ray cluster on this machine ({exc}); "
            "give the cluster's HOST:PORT instead"
        ) from None
    if found is None:
        raise ClusterUnreachable(f"{source}='auto' found no Ray cluster on this machine")
    return found


def reachable(address: str, source: str, timeout_s: float) -> str:
    """The address to give `ray.init`, once its GCS port accepted a connection within
    `timeout_s` (the caller's `ClusterConfig.connect_timeout_s`).

    Raises `ClusterUnreachable` (nothing listens, the host is unknown, or no
    answer within `timeout_s`) or `ConfigError` (not an address) naming
    `source`. Costs one TCP handshake; nothing is sent.
    """
    resolved = _resolve_auto(source) if address == "auto" else address
    host, port = split_address(resolved, source)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        shown = address if resolved == address else f"{address} ({resolved})"
        raise ClusterUnreachable(
            f"no Ray cluster answers at {source}={shown}: {reason} within {timeout_s:g}s; "
            "is the cluster running (`kvmesh start`), and is the address right?"
        ) from None
    return resolved


__all__ = [
    "RAY_ADDRESS_VARIABLE",
    "address_from_environment",
    "reachable",
    "split_address",
]
