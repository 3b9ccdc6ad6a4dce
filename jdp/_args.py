"""Checks of user arguments, one rule for all: TypeError for the wrong kind, ValueError for the wrong value."""

import numbers


def check_bool(value: object, name: str, *, where: str) -> bool:
    """``value``, refused unless it is a bool (``1`` or ``"yes"`` would read as True).

    Example:
      >>> check_bool(False, "has_aux", where="jdp.make_train_step")
      False
    """
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {value!r}.")
    return value


def check_name(value: object, name: str, *, where: str) -> str:
    """``value``, refused unless it is a non-empty string (an axis name, a metric name)."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{where}: {name} must be a non-empty string, got {value!r}.")
    return value


def check_int(value: object, name: str, *, minimum: int, where: str) -> int:
    """``value`` as an int, refused unless it is an int (not a bool) >= ``minimum``.

    Example:
      >>> check_int(3, "log_every", minimum=1, where="jdp.fit")
      3
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{where}: {name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})."
        )
    if value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}.")
    return int(value)
