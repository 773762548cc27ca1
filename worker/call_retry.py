"""How a failed transfer call is answered: retried (one policy for every call) or translated.

`RetryPolicy.run` is the one retry loop of the transfer client: bounded,
jittered and exponential, only on ``UNAVAILABLE`` and only for idempotent
calls (Lookup, Health, FetchPages; never PushPages), always within the
call's deadline. `translate` turns a failed call into the kvmesh error that
names the peer and what to do: the server's own class when it sent one
(``kvmesh-error`` trailing metadata), else one by status.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from kvmesh.config import TransferConfig
from kvmesh.errors import (
    ChecksumMismatch,
    DeadlineExceeded,
    InvalidInput,
    KVMeshError,
    MessageTooLarge,
    TransportError,
    Unauthenticated,
)
from kvmesh.grpc_security import error_from_rpc

T = TypeVar("T")


HINTS: dict[type[KVMeshError], str] = {
    TransportError: "check that the peer is running and reachable (kvmesh status)",
    DeadlineExceeded: "the peer is slow or stuck; retry later or raise TransferConfig.deadline_s",
    Unauthenticated: "use the cluster's auth_token and a client certificate from its CA",
    MessageTooLarge: "use the same max_message_bytes / chunk_bytes on every worker",
    ChecksumMismatch: "the page was corrupted on the way; fetch it again",
}


def translate(err: grpc.RpcError, what: str, address: str) -> KVMeshError:
    """The kvmesh error for a failed call to a peer (`error_from_rpc`: the server's class if
    it sent one, else by status), with what to do about it."""
    error = error_from_rpc(err, what, f"peer {address}")
    hint = next((HINTS[c] for c in type(error).__mro__ if c in HINTS), "")
    return type(error)(f"{error}; {hint}") if hint else error


@dataclass(slots=True)
class RetryPolicy:
    """Retries of one client's calls: ``retries`` extra attempts on ``UNAVAILABLE``,
    backoff ``retry_backoff_s * 2**n`` jittered by [0.5, 1.5), never past the deadline.

    `rng` and `sleep` are injectable for deterministic tests.
    """

    address: str
    retries: int
    backoff_s: float
    rng: random.Random = field(default_factory=random.Random)
    sleep: Callable[[float], None] = time.sleep

    @classmethod
    def of(
        cls,
        address: str,
        config: TransferConfig,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> RetryPolicy:
        return cls(
            address,
            config.retries,
            config.retry_backoff_s,
            rng if rng is not None else random.Random(),
            sleep if sleep is not None else time.sleep,
        )

    def deadline(self, timeout_s: float) -> float:
        """The monotonic end of a call given `timeout_s` (refused unless positive)."""
        if timeout_s <= 0:
            raise InvalidInput(f"deadline must be positive, got {timeout_s}")
        return time.monotonic() + timeout_s

    def remaining(self, end: float, what: str) -> float:
        left = end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(
                f"{what} to peer {self.address} ran out of its deadline; {HINTS[DeadlineExceeded]}"
            )
        return left

    def run(self, what: str, attempt: Callable[[float], T], end: float, *, idempotent: bool) -> T:
        """`attempt(seconds left)` until it returns; a failed call (`grpc.RpcError`) is
        retried when the policy allows it, else raised as its kvmesh error."""
        tries = 0
        while True:
            timeout = self.remaining(end, what)
            try:
                return attempt(timeout)
            except grpc.RpcError as err:
                retry = (
                    idempotent
                    and err.code() == grpc.StatusCode.UNAVAILABLE
                    and tries < self.retries
                )
                if not retry:
                    raise translate(err, what, self.address) from None
            backoff = self.backoff_s * (2**tries) * (0.5 + self.rng.random())
            tries += 1
            self.sleep(min(backoff, max(0.0, self.remaining(end, what) - 0.001)))
