"""What every check shares: the error it raises and how it reports success."""
from __future__ import annotations


class CheckFailed(AssertionError):
    """An exercise result is wrong. The message says what to fix."""


def passed(message: str):
    print(f"\u2713 {message}")


def first_difference(got: list, want: list) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"position {i}: got {a!r}, expected {b!r}"
    return f"lengths differ: got {len(got)} items, expected {len(want)}"
