"""The worker registry: registration, heartbeats, expiry and drain on an injected clock."""

from __future__ import annotations

import pytest

from kvmesh.coordination import WorkerRegistration
from kvmesh.coordinator.policies import WorkerLoad
from kvmesh.coordinator.registry import WorkerRegistry
from kvmesh.errors import InvalidInput, UnknownWorker
from kvmesh.types import WorkerId

A, B = WorkerId("worker-a"), WorkerId("worker-b")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_registered_worker_starts_idle_with_its_capacity_free() -> None:
    reg = WorkerRegistry(Clock())
    info = reg.register(WorkerRegistration(A, "127.0.0.1:5000", 64, "inc-1", "prefill"))
    assert (info.capacity, info.role, info.registered_at) == (64, "prefill", 100.0)
    assert info.load == WorkerLoad(A, free_pages=64, total_pages=64)
    assert A in reg and len(reg) == 1


def test_heartbeats_keep_a_worker_alive_and_silence_expires_it() -> None:
    clock = Clock()
    reg = WorkerRegistry(clock)
    reg.register(WorkerRegistration(A, "a", 8, "i"))
    reg.register(WorkerRegistration(B, "b", 8, "i"))
    clock.t = 104.0
    reg.heartbeat(A, WorkerLoad(A, active_prefill_tokens=7))
    clock.t = 106.0
    assert reg.expire(timeout=5.0) == [B]
    assert reg.get(A).load.active_prefill_tokens == 7
    assert reg.expire(now=109.5, timeout=5.0) == [A]
    assert len(reg) == 0


def test_a_heartbeat_from_an_unknown_worker_says_register_again() -> None:
    reg = WorkerRegistry(Clock())
    with pytest.raises(UnknownWorker, match="register it again"):
        reg.heartbeat(A)


def test_a_load_reported_for_another_worker_is_rejected() -> None:
    reg = WorkerRegistry(Clock())
    reg.register(WorkerRegistration(A, "a", 8, "i"))
    with pytest.raises(InvalidInput):
        reg.heartbeat(A, WorkerLoad(B))


def test_re_registering_the_same_incarnation_keeps_load_drain_and_start_time() -> None:
    clock = Clock()
    reg = WorkerRegistry(clock)
    reg.register(WorkerRegistration(A, "a", 8, "i"))
    reg.heartbeat(A, WorkerLoad(A, active_decode_pages=3))
    reg.drain(A)
    clock.t = 150.0
    info = reg.register(WorkerRegistration(A, "a", 8, "i"))
    assert (info.registered_at, info.draining, info.load.active_decode_pages) == (100.0, True, 3)
    fresh = reg.register(WorkerRegistration(A, "a2", 16, "j"))
    assert (fresh.registered_at, fresh.draining, fresh.load.total_pages) == (150.0, False, 16)


def test_drain_marks_and_unmarks_a_worker() -> None:
    reg = WorkerRegistry(Clock())
    reg.register(WorkerRegistration(A, "a", 8, "i"))
    assert reg.drain(A).draining
    assert not reg.drain(A, draining=False).draining
    with pytest.raises(UnknownWorker):
        reg.drain(B)


def test_workers_are_listed_by_role() -> None:
    reg = WorkerRegistry(Clock())
    reg.register(WorkerRegistration(A, "a", 8, "i", "prefill"))
    reg.register(WorkerRegistration(B, "b", 8, "i", "decode"))
    reg.register(WorkerRegistration(WorkerId("c"), "c", 8, "i", "both"))
    assert [w.worker_id for w in reg.workers("prefill")] == ["c", A]
    assert [w.worker_id for w in reg.workers("decode")] == ["c", B]
    assert len(reg.workers()) == 3


@pytest.mark.parametrize(
    ("worker_id", "capacity", "incarnation", "role"),
    [("", 8, "i", "both"), ("a", -1, "i", "both"), ("a", 8, "", "both"), ("a", 8, "i", "boss")],
)
def test_bad_registrations_are_rejected(
    worker_id: str, capacity: int, incarnation: str, role: str
) -> None:
    reg = WorkerRegistry(Clock())
    with pytest.raises(InvalidInput):
        reg.register(WorkerRegistration(WorkerId(worker_id), "addr", capacity, incarnation, role))  # type: ignore[arg-type]
    assert len(reg) == 0
