"""How a leaf is cut into n rows, one per replica: whole, or layer by layer.

A leaf with at least n elements is flattened, zero-padded to a multiple of n
and cut into n equal slices of shape ``(1, ..., 1, c)`` (the leaf's rank is
kept, so masks such as ``lambda p: p.ndim > 1`` still select the same leaves).

A leaf stacked over layers (``(L, ...)``, as ``jax.lax.scan`` and Flax's
``nn.scan`` keep a model's blocks) can instead be cut layer by layer: each
layer is flattened, padded and cut in n on its own, so a replica's slice is
``(L, 1, ..., 1, c)`` and a scan over it hands each layer its own slice of
that layer. Its record in a state's ``logical_shapes`` is a :class:`PerLayer`
instead of the plain shape.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PerLayer:
    """The record of a leaf cut layer by layer: its whole shape, the layers on axis 0."""

    shape: tuple[int, ...]


Record = tuple[int, ...] | PerLayer


def whole_shape(record: Record) -> tuple[int, ...]:
    """The leaf's logical shape, whichever way it is cut."""
    return record.shape if isinstance(record, PerLayer) else record


def is_sharded_param(shape: tuple[int, ...], n: int) -> bool:
    """Whether a parameter leaf of this shape is split (n >= 2, rank >= 1, >= n elements)."""
    return n >= 2 and len(shape) >= 1 and math.prod(shape) >= n


def is_split_per_layer(shape: tuple[int, ...], n: int) -> bool:
    """Whether a stacked leaf of this shape is cut layer by layer (each layer has >= n elements)."""
    return len(shape) >= 2 and is_sharded_param(shape[1:], n)


def slice_shape(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """One replica's slice of a split leaf: ``(1, ..., 1, ceil(size / n))``."""
    return (1,) * (len(shape) - 1) + (-(-math.prod(shape) // n),)


def record_slice_shape(record: Record, n: int) -> tuple[int, ...]:
    """One replica's slice under ``record``: ``(L, 1, ..., 1, c)`` when cut layer by layer."""
    if isinstance(record, PerLayer):
        return (record.shape[0], *slice_shape(record.shape[1:], n))
    return slice_shape(record, n)


def _rows(x, n: int):
    """``(n, c)``: the flattened leaf, zero-padded, one row per replica."""
    flat = jnp.ravel(x)
    chunk = -(-flat.size // n)
    return jnp.pad(flat, (0, chunk * n - flat.size)).reshape(n, chunk)


def split_rows(x, record: Record, n: int):
    """``(n, *record_slice_shape(record, n))``: row i is replica i's slice."""
    if not isinstance(record, PerLayer):
        return _rows(x, n).reshape((n, *slice_shape(record, n)))
    layers = record.shape[0]
    flat = jnp.reshape(x, (layers, -1))
    chunk = -(-flat.shape[1] // n)
    padded = jnp.pad(flat, ((0, 0), (0, chunk * n - flat.shape[1])))
    per_layer = jnp.swapaxes(padded.reshape(layers, n, chunk), 0, 1)  # (n, L, c)
    return per_layer.reshape((n, *record_slice_shape(record, n)))


def join_rows(rows: np.ndarray, record: Record) -> np.ndarray:
    """The logical leaf from every replica's row (the inverse of :func:`split_rows`)."""
    rows = np.asarray(rows)
    if not isinstance(record, PerLayer):
        return rows.reshape(-1)[: math.prod(record)].reshape(record)
    n, layers = rows.shape[0], record.shape[0]
    per_layer = np.swapaxes(rows.reshape(n, layers, -1), 0, 1).reshape(layers, -1)
    return per_layer[:, : math.prod(record.shape[1:])].reshape(record.shape)
