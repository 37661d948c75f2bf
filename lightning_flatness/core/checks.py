"""Checks of the package's plain arguments (counts and choices), with messages naming them."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_choice", "check_count"]


def check_count(
    name: str, value: object, minimum: int = 1, *, allow_none: bool = False, meaning: str = ""
) -> int | None:
    """``value`` if it is an int ≥ ``minimum`` (or None, when ``allow_none``).

    Args:
        name: the argument's name, for the message.
        value: what was passed.
        minimum: the smallest accepted value (0 or 1 in this package).
        allow_none: None is accepted too.
        meaning: what the argument is, added to the message (e.g. "the training-set size n").

    Raises:
        ValueError: naming the argument and the value (bools are not counts).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer ≥ {minimum}"
        more = " or None" if allow_none else ""
        about = f" ({meaning})" if meaning else ""
        raise ValueError(f"`{name}` must be {kind}{more}{about}, got {name}={value!r}.")
    return value


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: naming the argument, the choices and the value.
    """
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {name}={value!r}.")
    return value
