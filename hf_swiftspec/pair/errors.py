"""The one error type of pair handling, and how other libraries' errors are quoted in it."""

from __future__ import annotations


class PairConfigError(ValueError):
    """A pair that cannot be used as given; the message names the field and how to fix it."""


def first_line(err: BaseException) -> str:
    """The first line of an error, for quoting a library's (often multi-line) message in ours."""
    text = str(err).strip().splitlines()
    return text[0].rstrip(".") if text else type(err).__name__
