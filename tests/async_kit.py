"""Waiting in async tests, shared by the modules that follow event streams.

A stream's effects arrive on their own schedule, so a test polls for the
state it expects, within a bound, and names what it waited for when the
bound passes (the failure then says which step never happened).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(
    check: Callable[[], bool], what: str, bound_s: float = 10.0, poll_s: float = 0.01
) -> None:
    """Returns once `check()` holds; raises AssertionError naming `what` after `bound_s`."""
    deadline = time.monotonic() + bound_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(poll_s)
