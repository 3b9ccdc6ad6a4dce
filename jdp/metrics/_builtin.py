"""The metrics jdp computes on request: the gradient norm and the learning rate."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jdp._tree import PyTree
from jdp.metrics._base import Metric, same


def grad_norm() -> Metric:
    """``grad_norm``: the global norm of the reduced, unscaled gradients.

    Under every strategy the norm of the whole gradient, whichever part a
    replica holds, so it matches single-device training.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jdp
      >>> step = jdp.shard_map(jdp.make_train_step(
      ...     lambda p, b: jnp.mean((b * p) ** 2), metrics=[jdp.metrics.grad_norm()]))
      >>> state = step.replicate(jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1)))
      >>> _, m = step(state, step.shard(np.ones(8, np.float32)))
      >>> float(m["grad_norm"][0])
      2.0
    """
    return Metric("grad_norm", lambda view: view.global_norm(view.grads), same)


def learning_rate(source: "bool | Callable[[jax.Array], jax.Array]" = True) -> Metric:
    """``learning_rate``: the rate this step used.

    Args:
      source: True reads it from an ``optax.inject_hyperparams`` state; an
        optax schedule evaluates it at the optimizer's own count.
    """
    if source is not True and not callable(source):
        raise TypeError(
            "jdp.metrics.learning_rate takes True or an optax schedule (a callable of the "
            f"step count), got {source!r}."
        )
    return Metric(
        "learning_rate", lambda view: _rate(source, view.before.opt_state, view.after.opt_state)
    )


def _rate(source, old_opt_state: PyTree, new_opt_state: PyTree) -> jax.Array:
    def find(tree, wanted):
        nodes = jax.tree.leaves(tree, is_leaf=wanted)
        return next((node for node in nodes if wanted(node)), None)

    if source is True:
        injected = find(
            new_opt_state,
            lambda x: (
                isinstance(getattr(x, "hyperparams", None), dict)
                and "learning_rate" in x.hyperparams
            ),
        )
        if injected is None:
            raise ValueError(
                "jdp.metrics.learning_rate: log_learning_rate=True reads the rate from optax.inject_hyperparams state, "
                "and the optimizer has none: wrap it, optax.inject_hyperparams(optax.adam)"
                "(learning_rate=...), or pass the schedule: log_learning_rate=schedule."
            )
        return jnp.asarray(injected.hyperparams["learning_rate"], jnp.float32)
    counter = find(old_opt_state, lambda x: isinstance(x, optax.ScaleByScheduleState))
    if counter is None:
        raise ValueError(
            "jdp.metrics.learning_rate: log_learning_rate=schedule needs an optimizer built with that schedule "
            "(its state holds the schedule's count), e.g. optax.adam(schedule)."
        )
    return jnp.asarray(source(counter.count), jnp.float32)
