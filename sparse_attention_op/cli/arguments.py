"""argparse types shared by the command line and the scripts: an integer option's range is
checked where it is parsed, and a mistake is a usage error (exit 2) that names the option."""

from __future__ import annotations

import argparse


class UsageError(ValueError):
    """Options that contradict each other or a rule, found after parsing (by a command):
    the command line reports it as argparse reports its own, with exit status 2."""


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
