"""TrainState: everything a training step changes, in one pytree."""

from typing import Any, Self

import jax
import jax.numpy as jnp
import optax

from jdp import _tree as pytree
from jdp._loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from jdp._tree import PyTree


@pytree.dataclass
class TrainState:
    """The training state: every leaf a step updates, and the optimizer.

    Attributes:
      step: step calls so far (int32). It also advances on a step that is
        skipped for non-finite gradients; see ``skipped_steps``.
      params: the model parameters (float32 master copy).
      opt_state: the optax state for ``params``.
      loss_scale: a :class:`jdp.NoOpLossScale`, :class:`jdp.StaticLossScale`
        or :class:`jdp.DynamicLossScale`.
      model_state: mutable model collections such as Flax ``batch_stats``
        (averaged across replicas every step), or None.
      rng: a PRNG key from which per-replica keys are derived, or None.
      skipped_steps: steps skipped for non-finite gradients so far (int32).
      tx: the optax transformation (static, not a leaf).

    Subclasses with extra fields are frozen dataclasses and pytrees
    automatically (like Flax's ``struct.PyTreeNode``), so they replicate,
    run under both backends and checkpoint like the base class; mark
    hyperparameters with ``jdp.static_field()``:

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdp
      >>> from typing import Any, Self
      >>> class EMAState(jdp.TrainState):
      ...     ema: Any = None
      >>> s = EMAState.create(params=jnp.ones(2), tx=optax.sgd(0.1), ema=jnp.zeros(2))
      >>> [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s)[0]][-1]
      '.ema'
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        pytree.dataclass(cls)

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    loss_scale: LossScale
    model_state: PyTree
    rng: jax.Array | None
    skipped_steps: jax.Array
    tx: optax.GradientTransformation = pytree.static_field()

    @classmethod
    def create(
        cls,
        *,
        params: PyTree,
        tx: optax.GradientTransformation,
        loss_scale: LossScale | None = None,
        model_state: PyTree = None,
        rng: jax.Array | None = None,
        **fields: Any,
    ) -> Self:
        """A fresh state at step 0 with ``tx.init(params)``.

        Args:
          params: the initial parameters (one copy; replicate it afterwards).
          tx: an optax ``GradientTransformation``.
          loss_scale: a jdp loss scale; default :class:`jdp.NoOpLossScale`.
          model_state: initial mutable model collections, e.g. Flax
            ``variables["batch_stats"]``.
          rng: a PRNG key (``jax.random.key(0)``) for dropout and friends.
          **fields: the extra fields of a subclass.

        Example:
          >>> import jax.numpy as jnp, optax, jdp
          >>> state = jdp.TrainState.create(params={"w": jnp.zeros(3)}, tx=optax.sgd(0.1))
          >>> int(state.step), state.params["w"].shape
          (0, (3,))
        """
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(
                "jdp.TrainState.create: tx must be an optax.GradientTransformation "
                f"(with init and update), got {type(tx).__name__}."
            )
        if loss_scale is None:
            loss_scale = NoOpLossScale()
        if not isinstance(loss_scale, (NoOpLossScale, StaticLossScale, DynamicLossScale)):
            raise TypeError(
                "jdp.TrainState.create: loss_scale must be a jdp.NoOpLossScale, "
                f"StaticLossScale or DynamicLossScale, got {type(loss_scale).__name__}."
            )
        if rng is not None and not _is_key(rng):
            raise TypeError(
                "jdp.TrainState.create: rng must be a PRNG key such as "
                f"jax.random.key(0), got {rng!r:.60}."
            )
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            loss_scale=loss_scale,
            model_state=model_state,
            rng=rng,
            skipped_steps=jnp.zeros((), jnp.int32),
            tx=tx,
            **fields,
        )

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed."""
        return pytree.replace(self, **changes)


def _is_key(x) -> bool:
    if not hasattr(x, "dtype"):
        return False
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x.ndim == 0
    return x.dtype == jnp.uint32 and x.shape == (2,)
