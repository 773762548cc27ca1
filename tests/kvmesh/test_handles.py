"""The handle protocols of kvmesh.handles say what the actor classes really take and answer.

A Ray `ActorHandle` fits any protocol (mypy sees its methods as `Never`), so
nothing but this test keeps a protocol true to the actor behind it: every
method it names exists on each actor class, with the same parameter types
in the same order and the same result.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Sequence
from typing import Any

import pytest

import kvmesh.handles as handles
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.actor import CoordinatorActor
from kvmesh.coordinator.registry import WorkerInfo
from kvmesh.coordinator.router import RouterActor
from kvmesh.coordinator.service import Coordinator, ReportResult
from kvmesh.handles import (
    CoordinatorHandle,
    InProcessCoordinator,
    RegisteredWorker,
    ReportReply,
    WorkerActorHandle,
)
from kvmesh.rendezvous import DistRendezvous
from kvmesh.requests import (
    GenerateRequest,
    GenerationResult,
    PrefillResult,
    ReportMark,
    Role,
    RouteDecision,
    WorkerStats,
)
from kvmesh.types import WorkerId
from kvmesh.worker.actor import WorkerActor

NAMES: dict[str, Any] = {
    **vars(handles),
    "Sequence": Sequence,
    "RouteQuery": RouteQuery,
    "WorkerRegistration": WorkerRegistration,
    "WorkerReport": WorkerReport,
    "DistRendezvous": DistRendezvous,
    "GenerateRequest": GenerateRequest,
    "GenerationResult": GenerationResult,
    "PrefillResult": PrefillResult,
    "ReportMark": ReportMark,
    "Role": Role,
    "RouteDecision": RouteDecision,
    "WorkerStats": WorkerStats,
    "WorkerId": WorkerId,
}


def remote_methods(protocol: type) -> dict[str, tuple[tuple[Any, ...], Any]]:
    """Each remote method a handle protocol names: (its parameter types, its result)."""
    out = {}
    for name, member in vars(protocol).items():
        if isinstance(member, property) and not name.startswith("_"):
            hint = typing.get_type_hints(member.fget, globalns=NAMES)["return"]
            params, result = typing.get_args(hint)
            out[name] = (tuple(params), result)
    return out


def actor_signature(actor: type, name: str) -> tuple[list[Any], list[Any], Any]:
    """(required parameter types, optional ones, result) of an actor's method, `self` left out."""
    method = getattr(actor, name)
    hints = typing.get_type_hints(method)
    # Ray adds `_ray_trace_ctx` to an actor class's methods once it has made it an actor
    params = [
        p
        for p in list(inspect.signature(method).parameters.values())[1:]
        if not p.name.startswith("_ray_")
    ]
    required = [hints[p.name] for p in params if p.default is inspect.Parameter.empty]
    optional = [hints[p.name] for p in params if p.default is not inspect.Parameter.empty]
    return required, optional, hints["return"]


CASES = [
    (WorkerActorHandle, WorkerActor),
    (CoordinatorHandle, CoordinatorActor),
    (CoordinatorHandle, RouterActor),
]


@pytest.mark.parametrize(("protocol", "actor"), CASES)
def test_every_method_a_handle_names_takes_the_actors_parameters_in_order(
    protocol: type, actor: type
) -> None:
    methods = remote_methods(protocol)
    assert methods, f"{protocol.__name__} names no remote method"
    for name, (params, _) in methods.items():
        assert hasattr(actor, name), f"{actor.__name__} has no method {name!r}"
        required, optional, _ = actor_signature(actor, name)
        assert len(required) <= len(params) <= len(required) + len(optional), name
        assert list(params) == (required + optional)[: len(params)], name


def fits(returned: Any, wanted: Any) -> bool:
    """Whether a value of type `returned` is what a protocol's `wanted` result promises:
    the same type, any type for `object`, a record with a protocol's fields, or a list of
    such records for a sequence of the protocol."""
    if wanted is object or returned == wanted:
        return True
    if getattr(wanted, "_is_protocol", False):
        return dataclasses.is_dataclass(returned) and has_the_fields(returned, wanted)
    if typing.get_origin(wanted) is Sequence and typing.get_origin(returned) in (list, tuple):
        (item,) = typing.get_args(wanted)
        return fits(typing.get_args(returned)[0], item)
    return False


def has_the_fields(record: type, protocol: type) -> bool:
    """Whether `record` has every property `protocol` names, with the same type."""
    hints = typing.get_type_hints(record)
    named = [n for n, m in vars(protocol).items() if isinstance(m, property)]
    return bool(named) and all(
        hints.get(n) == typing.get_type_hints(getattr(protocol, n).fget, globalns=NAMES)["return"]
        for n in named
    )


@pytest.mark.parametrize(("protocol", "actor"), CASES)
def test_every_method_a_handle_names_answers_what_the_actor_returns(
    protocol: type, actor: type
) -> None:
    for name, (_, result) in remote_methods(protocol).items():
        _, _, returned = actor_signature(actor, name)
        assert fits(returned, result), f"{actor.__name__}.{name} returns {returned}, not {result}"


def test_the_coordinators_records_and_replies_have_what_the_protocols_name() -> None:
    assert has_the_fields(WorkerInfo, RegisteredWorker)
    assert has_the_fields(ReportResult, ReportReply)


def test_the_in_process_coordinator_takes_and_answers_what_a_worker_calls() -> None:
    for name in ("register_worker", "report"):
        wanted = typing.get_type_hints(getattr(InProcessCoordinator, name), globalns=NAMES)
        required, _, returned = actor_signature(Coordinator, name)
        assert required == [v for k, v in wanted.items() if k != "return"], name
        assert fits(returned, wanted["return"]), name


def test_the_reader_sees_a_record_without_a_protocols_field() -> None:
    @dataclasses.dataclass
    class Partial:
        worker_id: WorkerId

    assert not has_the_fields(Partial, RegisteredWorker)
    assert not fits(list[Partial], Sequence[RegisteredWorker])


def test_the_reader_sees_a_parameter_the_actor_does_not_take() -> None:
    class Narrow:
        def generate(self) -> GenerationResult:
            raise NotImplementedError

    required, optional, _ = actor_signature(Narrow, "generate")
    params, _ = remote_methods(WorkerActorHandle)["generate"]
    assert list(params) != (required + optional)[: len(params)]
