"""Frozen dataclasses registered as pytrees, with every field accounted for.

jmp's hand-written ``tree_flatten`` silently drops ``min_loss_scale``; here the
flatten and unflatten functions are derived from ``dataclasses.fields`` so no
field can be forgotten. Unflattening bypasses ``__init__``: JAX rebuilds trees
with tracers, ``None`` or ints as leaves (``in_axes`` specs), and argument
validation in ``__post_init__`` must only ever see values a user passed.
"""

import copy
import dataclasses
from typing import Any, TypeAlias, TypeVar

import jax

PyTree: TypeAlias = Any
"""Any nested structure of lists, tuples, dicts, dataclasses and arrays."""

_T = TypeVar("_T")


def is_prng_key(x: object) -> bool:
    """True for a typed PRNG key array (``jax.random.key``)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is part of the treedef (hashed), not a leaf."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def dataclass(cls: type[_T]) -> type[_T]:
    """Makes ``cls`` a frozen dataclass and registers it as a pytree node.

    Fields created with :func:`static_field` become auxiliary data; all other
    fields are children, in declaration order.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get("static", False))
    meta = tuple(f.name for f in fields if f.metadata.get("static", False))
    keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

    def flatten(obj):
        return [getattr(obj, n) for n in data], tuple(getattr(obj, n) for n in meta)

    def flatten_with_keys(obj):
        return list(zip(keys, (getattr(obj, n) for n in data), strict=True)), tuple(
            getattr(obj, n) for n in meta
        )

    def unflatten(aux, children):
        obj = object.__new__(cls)
        for name, value in zip(meta, aux, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(data, children, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten_func=flatten)
    return cls


def replace(obj: _T, **changes: Any) -> _T:
    """A copy of ``obj`` with some fields changed, without re-running validation.

    ``dataclasses.replace`` calls ``__init__``, which would validate traced
    values; this copies the instance and sets the fields directly.
    """
    names = {f.name for f in dataclasses.fields(obj)}
    unknown = set(changes) - names
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {sorted(unknown)}.")
    new = copy.copy(obj)
    for name, value in changes.items():
        object.__setattr__(new, name, value)
    return new
