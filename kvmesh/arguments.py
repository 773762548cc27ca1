"""Command-line value types, in one place, so every flag of every command refuses alike.

argparse calls a flag's ``type`` on the text given; these raise
`argparse.ArgumentTypeError`, which argparse turns into one usage error
naming the flag (``kvmesh bench router: error: argument --workers: must be a
positive integer, got '0'``) before anything starts. The CLI, the demo, the
simulator and every benchmark take their numbers through them: a range
checked here never reaches a traceback further in.
"""

from __future__ import annotations

import argparse
import math


def _number(text: str, kind: type[int] | type[float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        word = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {word}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _at_least(value: float, text: str, low: float, strict: bool, what: str) -> None:
    if value < low or (strict and value == low):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")


def positive_int(text: str) -> int:
    """An integer >= 1 (counts: workers, requests, pages)."""
    value = int(_number(text, int))
    _at_least(value, text, 0, True, "a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (optional counts, where 0 means none)."""
    value = int(_number(text, int))
    _at_least(value, text, 0, False, "an integer >= 0")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (durations, rates, CPUs)."""
    value = _number(text, float)
    _at_least(value, text, 0, True, "a positive number")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (time scales, GPUs, where 0 means none)."""
    value = _number(text, float)
    _at_least(value, text, 0, False, "a number >= 0")
    return value


def tcp_port(text: str) -> int:
    """A TCP port, 0..65535 (0: the system picks a free one)."""
    value = int(_number(text, int))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535, got {text!r}")
    return value


__all__ = [
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "tcp_port",
]
