"""The flag types every command shares: a bad value is argparse's one-line usage error."""

from __future__ import annotations

import argparse

import pytest

from kvmesh.arguments import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [
        (positive_int, "3", 3),
        (non_negative_int, "0", 0),
        (positive_float, "0.5", 0.5),
        (non_negative_float, "0", 0.0),
    ],
)
def test_good_values_parse_to_their_type(parse: object, text: str, value: object) -> None:
    assert callable(parse)
    got = parse(text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (positive_int, "0", "must be a positive integer, got '0'"),
        (positive_int, "-5", "must be a positive integer, got '-5'"),
        (positive_int, "1.5", "must be an integer, got '1.5'"),
        (non_negative_int, "-1", "must be an integer >= 0, got '-1'"),
        (positive_float, "0", "must be a positive number, got '0'"),
        (positive_float, "inf", "must be a finite number, got 'inf'"),
        (non_negative_float, "nan", "must be a finite number, got 'nan'"),
        (non_negative_float, "-0.1", "must be a number >= 0, got '-0.1'"),
    ],
)
def test_bad_values_are_refused_with_what_was_expected_and_what_came(
    parse: object, text: str, message: str
) -> None:
    assert callable(parse)
    with pytest.raises(argparse.ArgumentTypeError) as bad:
        parse(text)
    assert str(bad.value) == message


def test_argparse_names_the_flag_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvmesh x")
    parser.add_argument("--workers", type=positive_int)
    with pytest.raises(SystemExit):
        parser.parse_args(["--workers", "0"])
    assert "argument --workers: must be a positive integer, got '0'" in capsys.readouterr().err
