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
from kvmesh.coordination import RouteQuery
from kvmesh.coordinator.actor import CoordinatorActor
from kvmesh.coordinator.registry import WorkerInfo
from kvmesh.coordinator.router import RouterActor
from kvmesh.handles import CoordinatorHandle, RegisteredWorker, WorkerActorHandle
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


@pytest.mark.parametrize(("protocol", "actor"), CASES)
def test_every_method_a_handle_names_answers_what_the_actor_returns(
    protocol: type, actor: type
) -> None:
    for name, (_, result) in remote_methods(protocol).items():
        _, _, returned = actor_signature(actor, name)
        if name == "workers":  # the coordinator's records, seen as the base's protocol
            assert typing.get_origin(returned) is list
            assert typing.get_args(returned) == (WorkerInfo,)
            continue
        assert returned == result, f"{actor.__name__}.{name} returns {returned}, not {result}"


def test_the_coordinators_worker_records_have_what_a_registered_worker_names() -> None:
    fields = {f.name: f.type for f in dataclasses.fields(WorkerInfo)}
    named = [n for n, m in vars(RegisteredWorker).items() if isinstance(m, property)]
    assert named
    for name in named:
        assert name in fields, f"WorkerInfo has no field {name!r}"
    hints = typing.get_type_hints(WorkerInfo)
    for name in named:
        wanted = typing.get_type_hints(getattr(RegisteredWorker, name).fget, globalns=NAMES)
        assert hints[name] == wanted["return"], name


def test_the_reader_sees_a_parameter_the_actor_does_not_take() -> None:
    class Narrow:
        def generate(self) -> GenerationResult:
            raise NotImplementedError

    required, optional, _ = actor_signature(Narrow, "generate")
    params, _ = remote_methods(WorkerActorHandle)["generate"]
    assert list(params) != (required + optional)[: len(params)]
