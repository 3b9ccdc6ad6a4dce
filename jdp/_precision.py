"""Mixed precision: which arrays the forward and backward pass see in 16 bits.

The anchor is jmp's ``Policy(param_dtype, compute_dtype, output_dtype)``:
master parameters keep their own dtype (the optimizer, the all-reduce and the
update run in it), the loss comes back in float32, and a copy of the floating
parameters is cast to ``compute_dtype`` for the pass. Batch leaves are cast
only when named: inputs usually should be, regression targets never (a
bfloat16 target of 1000 rounds to a multiple of 4).
"""

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp

from jdp import _tree
from jdp._tree import PyTree

BatchSelector = Collection[str] | Callable[[str, jax.Array], bool]


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy for :func:`jdp.make_train_step`.

    Args:
      compute_dtype: the dtype of the forward and backward pass, e.g.
        ``jnp.bfloat16``; None computes in the parameters' own dtype.
      cast_batch: which floating batch leaves are cast to ``compute_dtype``:
        a collection of names, each matching a leaf when it is a dict key or
        attribute name anywhere on the leaf's path (``("image",)`` casts
        ``batch["image"]``); or a predicate ``(path, leaf) -> bool`` on the
        leaf's path string (``"['image']"``). Default: no batch leaf is cast.
        Integer leaves are never cast.

    Example:
      >>> import jax.numpy as jnp, numpy as np, jdp
      >>> policy = jdp.Policy(jnp.bfloat16, cast_batch=("image",))
      >>> batch = policy.cast_batch_leaves({"image": np.ones(2, np.float32),
      ...                                   "target": np.full(2, 1001.0, np.float32)})
      >>> batch["image"].dtype, float(batch["target"][0])
      (dtype(bfloat16), 1001.0)
    """

    compute_dtype: Any = None
    cast_batch: BatchSelector = ()

    def __post_init__(self):
        try:
            floating = self.compute_dtype is None or jnp.issubdtype(
                self.compute_dtype, jnp.floating
            )
        except TypeError:  # not a dtype at all ("float8")
            floating = False
        if not floating:
            raise TypeError(
                f"jdp.Policy: compute_dtype must be a floating dtype such as jnp.bfloat16, "
                f"got {self.compute_dtype!r}."
            )
        if isinstance(self.cast_batch, str):
            raise TypeError(
                f"jdp.Policy: cast_batch must be a collection of names, got the string "
                f"{self.cast_batch!r}; write cast_batch=({self.cast_batch!r},)."
            )
        if not callable(self.cast_batch):
            object.__setattr__(self, "cast_batch", tuple(self.cast_batch))
        if self.cast_batch and self.compute_dtype is None:
            raise ValueError("jdp.Policy: cast_batch needs a compute_dtype to cast to.")

    def cast_params(self, params: PyTree) -> PyTree:
        """Floating ``params`` in ``compute_dtype`` (unchanged when it is None)."""
        return jax.tree.map(self._cast, params)

    def cast_batch_leaves(self, batch: PyTree) -> PyTree:
        """The batch with the selected floating leaves in ``compute_dtype``.

        Raises:
          ValueError: a name in ``cast_batch`` matches no leaf of the batch.
        """
        if self.compute_dtype is None or not self.cast_batch:
            return batch
        flat, treedef = _tree.flatten_with_path(batch)
        chosen = [self._selected(path, leaf) for path, leaf in flat]
        if not callable(self.cast_batch):
            found = {name for path, _ in flat for name in _names(path)}
            missing = sorted(set(self.cast_batch) - found)
            if missing:
                raise ValueError(
                    f"jdp.Policy(cast_batch={self.cast_batch}): no batch leaf is named "
                    f"{missing}; the batch has {sorted(found)}."
                )
        return treedef.unflatten(
            [
                self._cast(leaf) if pick else leaf
                for (_, leaf), pick in zip(flat, chosen, strict=True)
            ]
        )

    def _selected(self, path, leaf) -> bool:
        if callable(self.cast_batch):
            return bool(self.cast_batch(jax.tree_util.keystr(path), leaf))
        return any(name in self.cast_batch for name in _names(path))

    def _cast(self, x):
        if self.compute_dtype is None or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x
        return jnp.asarray(x).astype(self.compute_dtype)


def _names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]


def as_policy(precision: "Policy | Any | None") -> Policy:
    """A :class:`Policy` from a policy, a bare compute dtype, or None."""
    if isinstance(precision, Policy):
        return precision
    if precision is None:
        return Policy()
    try:
        return Policy(compute_dtype=precision)
    except TypeError as e:
        raise TypeError(
            f"jdp.make_train_step: precision must be a jdp.Policy or a floating dtype such as "
            f"jnp.bfloat16, got {precision!r}."
        ) from e
