"""The names of jdp's own metrics, and the learning-rate metric.

One list for the step (aux keys may not clash with them) and the loop (which
of them are the same on every replica, so never weighted).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jdp._tree import PyTree

# The same value on every replica: fit never weights them ("weight" is summed).
REPLICA_INVARIANT = ("grads_finite", "loss_scale", "skipped_steps", "grad_norm", "learning_rate")
RESERVED_METRICS = ("loss", "weight", "virtual_replica_loss") + REPLICA_INVARIANT


def learning_rate(
    source: "bool | Callable[[jax.Array], jax.Array]", old_opt_state: PyTree, new_opt_state: PyTree
) -> jax.Array:
    """The learning rate of this step, from inject_hyperparams or a schedule."""

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
                "log_learning_rate=True reads the rate from optax.inject_hyperparams state, "
                "and the optimizer has none: wrap it, optax.inject_hyperparams(optax.adam)"
                "(learning_rate=...), or pass the schedule: log_learning_rate=schedule."
            )
        return jnp.asarray(injected.hyperparams["learning_rate"], jnp.float32)
    if not callable(source):
        raise TypeError(f"log_learning_rate must be True or an optax schedule, got {source!r}.")
    counter = find(old_opt_state, lambda x: isinstance(x, optax.ScaleByScheduleState))
    if counter is None:
        raise ValueError(
            "log_learning_rate=schedule needs an optimizer built with that schedule "
            "(its state holds the schedule's count), e.g. optax.adam(schedule)."
        )
    return jnp.asarray(source(counter.count), jnp.float32)
