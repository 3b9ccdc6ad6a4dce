"""Frozen dataclasses registered as pytrees, with every field accounted for.

jmp's hand-written ``tree_flatten`` silently drops ``min_loss_scale``; here the
flatten and unflatten functions are derived from ``dataclasses.fields`` so no
field can be forgotten. Unflattening bypasses ``__init__``: JAX rebuilds trees
with tracers, ``None`` or ints as leaves (``in_axes`` specs), and argument
validation in ``__post_init__`` must only ever see values a user passed.
"""

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar, dataclass_transform

import jax
import numpy as np

PyTree: TypeAlias = Any
"""Any nested structure of lists, tuples, dicts, dataclasses and arrays."""

_T = TypeVar("_T")


def is_prng_key(x: object) -> bool:
    """True for a typed PRNG key array (``jax.random.key``)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(dtype, np.dtype):  # a key's dtype is JAX's own: 50x faster
        return False
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is part of the treedef (hashed), not a leaf."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, static_field))
def dataclass(cls: type[_T]) -> type[_T]:
    """Makes ``cls`` a frozen dataclass and registers it as a pytree node.

    Fields created with :func:`static_field` become auxiliary data; all other
    fields are children, in declaration order. A class without
    ``__post_init__`` is registered natively (``jax.tree_util.register_dataclass``:
    flattened in C++, which is what a jitted call pays for on every call); a
    class that validates in ``__post_init__`` is rebuilt without calling it.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    data = tuple(f.name for f in fields if not f.metadata.get("static", False))
    meta = tuple(f.name for f in fields if f.metadata.get("static", False))
    if not hasattr(cls, "__post_init__"):
        jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))
        return cls
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
    names = {f.name for f in dataclasses.fields(obj)}  # type: ignore[arg-type]
    unknown = set(changes) - names
    if unknown:
        raise TypeError(f"jdp: {type(obj).__name__} has no field(s) {sorted(unknown)}.")
    new = copy.copy(obj)
    for name, value in changes.items():
        object.__setattr__(new, name, value)
    return new


def flatten(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], Any]:
    """``jax.tree.flatten``, typed: jaxlib's PyTreeDef does not resolve under mypy."""
    return jax.tree.flatten(tree, is_leaf=is_leaf)


def flatten_with_path(tree: PyTree) -> tuple[list[Any], Any]:
    """``jax.tree_util.tree_flatten_with_path``, typed as :func:`flatten` is."""
    return jax.tree_util.tree_flatten_with_path(tree)


def structure(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``jax.tree.structure``, typed as :func:`flatten` is."""
    return jax.tree.structure(tree, is_leaf=is_leaf)
