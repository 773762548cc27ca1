"""A worker serves each request in its scope: the request's id is on the errors it raises."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidInput
from kvmesh.requests import GenerateRequest, WorkerSpec
from kvmesh.types import WorkerId
from kvmesh.worker.actor import WorkerActor
from tests.worker.worker_kit import BASE


def test_a_request_the_worker_refuses_fails_with_its_id() -> None:
    worker = WorkerActor(WorkerSpec(WorkerId("ids-w0"), BASE))
    try:
        too_long = tuple([1] * (BASE.model.max_positions + 1))
        with pytest.raises(InvalidInput, match="max_positions") as refused:
            worker.generate(GenerateRequest("req-from-the-client", too_long, 1))
        assert refused.value.request_id == "req-from-the-client"
        assert worker.stats().errors == 1
    finally:
        worker.shutdown()
