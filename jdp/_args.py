"""Checks of user arguments, one rule for all: TypeError for the wrong kind, ValueError for the wrong value."""

import numbers


def check_int(value: object, name: str, *, minimum: int, where: str) -> int:
    """``value`` as an int, refused unless it is an int (not a bool) >= ``minimum``.

    Example:
      >>> check_int(3, "log_every", minimum=1, where="fit")
      3
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{where}: {name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})."
        )
    if value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}.")
    return int(value)
