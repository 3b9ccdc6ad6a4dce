"""Checks of user arguments, one rule for all: TypeError for the wrong kind, ValueError for the wrong value."""

import numbers

from jax import lax


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


def bound_axis_size(axis_name: str, where: str) -> int:
    """The size of ``axis_name``, refused by name where no step binds it.

    Example:
      >>> import jax
      >>> jax.vmap(lambda x: bound_axis_size("batch", "jdp.broadcast") + x, axis_name="batch")(
      ...     jax.numpy.zeros(3)).tolist()
      [3.0, 3.0, 3.0]
    """
    try:
        return lax.axis_size(axis_name)
    except NameError:
        # NameError as JAX raises it, so code catching JAX's error still does.
        raise NameError(
            f"{where} runs inside a step, over the data axis its backend binds ({axis_name!r} is "
            "not bound here): call it in the loss or a custom step wrapped with jdp.pmap or "
            "jdp.shard_map, with the backend's axis_name."
        ) from None
