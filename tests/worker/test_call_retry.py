"""The one retry policy of the transfer client (`kvmesh.worker.call_retry`), without a network:
what is retried, how long it waits, and the error a failed call becomes."""

from __future__ import annotations

import random
from collections.abc import Callable

import grpc
import pytest

from kvmesh.errors import DeadlineExceeded, InvalidInput, PermissionDenied, TransportError
from kvmesh.worker.call_retry import RetryPolicy, translate
from kvmesh.worker.h2_frames import WireStatus

UNAVAILABLE = WireStatus(grpc.StatusCode.UNAVAILABLE, "connection refused")


def policy(sleeps: list[float], retries: int = 3) -> RetryPolicy:
    return RetryPolicy("10.0.0.1:7000", retries, 0.1, random.Random(7), sleeps.append)


def failing(errors: list[WireStatus]) -> tuple[list[float], Callable[[float], str]]:
    """An attempt that raises `errors` in turn, then returns "ok"; and the timeouts it got."""
    timeouts: list[float] = []

    def attempt(timeout: float) -> str:
        timeouts.append(timeout)
        if errors:
            raise errors.pop(0)
        return "ok"

    return timeouts, attempt


def test_unavailable_is_retried_with_growing_jittered_backoff_then_succeeds() -> None:
    sleeps: list[float] = []
    retry = policy(sleeps)
    timeouts, attempt = failing([UNAVAILABLE, UNAVAILABLE, UNAVAILABLE])
    assert retry.run("Lookup", attempt, retry.deadline(30.0), idempotent=True) == "ok"
    assert len(timeouts) == 4 and len(sleeps) == 3
    for n, slept in enumerate(sleeps):
        assert 0.1 * 2**n * 0.5 <= slept < 0.1 * 2**n * 1.5


def test_retries_stop_at_their_bound_with_the_peer_named() -> None:
    sleeps: list[float] = []
    retry = policy(sleeps, retries=2)
    _, attempt = failing([UNAVAILABLE] * 5)
    with pytest.raises(TransportError, match=r"Lookup to peer 10\.0\.0\.1:7000 .*UNAVAILABLE"):
        retry.run("Lookup", attempt, retry.deadline(30.0), idempotent=True)
    assert len(sleeps) == 2


def test_a_call_that_is_not_idempotent_or_not_unavailable_is_never_retried() -> None:
    sleeps: list[float] = []
    retry = policy(sleeps)
    _, push = failing([UNAVAILABLE])
    with pytest.raises(TransportError):
        retry.run("PushPages", push, retry.deadline(30.0), idempotent=False)
    late = WireStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "too slow")
    _, fetch = failing([late])
    with pytest.raises(DeadlineExceeded, match=r"raise TransferConfig\.deadline_s"):
        retry.run("FetchPages", fetch, retry.deadline(30.0), idempotent=True)
    assert sleeps == []


def test_backoff_never_sleeps_past_the_deadline_and_a_spent_deadline_is_deadline_exceeded() -> None:
    sleeps: list[float] = []
    retry = RetryPolicy("peer:1", 5, 10.0, random.Random(1), sleeps.append)
    _, attempt = failing([UNAVAILABLE] * 10)
    end = retry.deadline(0.05)
    with pytest.raises((DeadlineExceeded, TransportError)):
        retry.run("Health", attempt, end, idempotent=True)
    assert sleeps and all(s <= 0.05 for s in sleeps)
    with pytest.raises(InvalidInput, match="deadline must be positive"):
        retry.deadline(0)


def test_the_servers_own_error_class_comes_back_with_its_details() -> None:
    refused = WireStatus(
        grpc.StatusCode.PERMISSION_DENIED,
        "no live push grant",
        [("kvmesh-error", "PermissionDenied")],
    )
    error = translate(refused, "PushPages", "10.0.0.1:7000")
    assert isinstance(error, PermissionDenied) and "no live push grant" in str(error)
    # A class whose status does not match is not trusted: the status decides.
    forged = WireStatus(grpc.StatusCode.UNAVAILABLE, "x", [("kvmesh-error", "PermissionDenied")])
    assert type(translate(forged, "Lookup", "p:1")) is TransportError
