"""Optional dependencies: a missing one is answered with the line that installs it."""

import importlib.util

# The import name of each optional package, and the name pip knows it by.
_DISTRIBUTIONS = {"flax": "flax", "sklearn": "scikit-learn", "matplotlib": "matplotlib"}


def require(modules: tuple[str, ...], extra: str, who: str) -> None:
    """Raises ``ModuleNotFoundError`` naming the install line if any of ``modules`` is missing.

    Args:
      modules: import names, e.g. ``("flax",)``.
      extra: the jdp extra that installs them, e.g. ``"flax"``.
      who: what needs them, for the message, e.g. ``"jdp.nnx"``.

    Example:
      >>> from jdp import _extras
      >>> _extras.require(("json",), "flax", "this example")
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        names = ", ".join(_DISTRIBUTIONS.get(m, m) for m in missing)
        raise ModuleNotFoundError(
            f"{who} needs {names}, which jdp installs only with its {extra!r} extra: "
            f"pip install 'jdp[{extra}]'.",
            name=missing[0],
        )
