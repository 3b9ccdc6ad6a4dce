"""A fault injector, for testing only: one flipped bit on one device at one step.

It models silent data corruption on one device: in its new state (a wrong
result of the update, or a bit that changed in memory after it), or, in
exact mode, in the gradients it computed for one virtual replica (a wrong
result of the forward or backward pass). The fault is data, not code (it
rides with the batch), so one compiled step injects any fault.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import metrics as _metrics
from jdp._args import check_int
from jdp._bitflip import FIELDS, FaultedBatch, flipped
from jdp._steps import TrainStep
from jdp._tree import PyTree, is_prng_key
from jdp.metrics import StepView

_NONE = -1  # a fault row's step for "no fault"
_INT32_END = 2**31
_STATE_METRICS = {
    "fingerprint": _metrics.fingerprint,
    "leaf_fingerprints": _metrics.leaf_fingerprints,
    "replicas_agree": _metrics.replicas_agree,
}


@dataclasses.dataclass(frozen=True)
class Fault:
    """One bit to flip at step ``step`` on replica ``replica``, in leaf ``leaf``.

    Attributes:
      step: the step (``state.step`` after it) that is hit.
      replica: the replica (its index on the data axis, across processes).
      leaf: the leaf's index in ``jax.tree.leaves(state)`` (the order
        :class:`jdp.Audit` names leaves in), or with
        ``with_faults(..., target="gradients")`` in ``jax.tree.leaves(params)``.
      index: the element of that leaf (its flat index, modulo the leaf's size).
      bit: the bit of that element (modulo its width in bits).
      virtual_replica: with ``target="gradients"``, the virtual replica whose
        gradients the device computes wrong: one of its own, or one it
        recomputes for exact mode's ``recompute_every`` check.

    Every field is an int >= 0 (an int32 in the rows). The fault is data, read
    inside the step: a replica or leaf past the step's last injects nothing.
    """

    step: int
    replica: int
    leaf: int
    index: int = 0
    bit: int = 0
    virtual_replica: int = 0

    def __post_init__(self) -> None:
        # The fields ride with the batch as int32; a value that does not fit
        # would wrap, and a negative one names no step, replica or leaf.
        for name in FIELDS:
            value = check_int(getattr(self, name), name, minimum=0, where="jdp.testing.Fault")
            if value >= _INT32_END:
                raise ValueError(
                    f"jdp.testing.Fault: {name}={value} does not fit the int32 rows the fault "
                    f"rides in the batch with; use a value below {_INT32_END}."
                )

    def rows(self, batch_size: int) -> np.ndarray:
        """The fault as ``(batch_size, 6)`` int32 rows, one per example, for the batch."""
        return _rows([getattr(self, name) for name in FIELDS], batch_size)


def no_fault(batch_size: int) -> np.ndarray:
    """Rows that inject nothing, for the steps between faults."""
    return _rows([_NONE] + [0] * (len(FIELDS) - 1), batch_size)


def _rows(spec: list[int], batch_size: int) -> np.ndarray:
    check_int(batch_size, "batch_size", minimum=1, where="jdp.testing.Fault.rows")
    return np.tile(np.asarray(spec, np.int32), (batch_size, 1))


def with_faults(step: TrainStep, target: str = "state") -> TrainStep:
    """``step`` taking ``(batch, fault rows)``: it flips the fault's bit.

    Testing only: it checks that a fault is caught (:class:`jdp.Audit`,
    ``jdp.metrics.replicas_agree``, ``jdp.metrics.fingerprint``, exact
    mode's ``recompute_every``).

    With ``target="state"`` the bit flips in the replica's new state, and
    the state metrics among the step's (``audit``, ``fingerprint``,
    ``leaf_fingerprints``, ``replicas_agree``) are computed again on the
    faulty state, as a fault that hit the device before them would be seen.
    With ``target="gradients"`` (exact mode only) it flips in the gradients
    the replica's device computes for the fault's virtual replica, the first
    time it computes them in the step (a transient fault), before any hash
    or sum reads them.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jdp
      >>> base = jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2), audit=jdp.Audit())
      >>> step = jdp.pmap(jdp.testing.with_faults(base))
      >>> state = step.replicate(jdp.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1)))
      >>> x = np.ones((16, 3), np.float32)
      >>> fault = jdp.testing.Fault(step=1, replica=5, leaf=1, index=2, bit=30)
      >>> state, metrics = step(state, step.shard((x, fault.rows(16))))
      >>> metrics["audit"][0].tolist()  # step 1: replica 5 differs at leaf 1 (params); 7 agree
      [1, 5, 1, 7]
    """
    if not isinstance(step, TrainStep):
        raise TypeError(
            f"jdp.testing.with_faults takes a step built by jdp.make_train_step, got {type(step).__name__}."
        )
    if not isinstance(target, str):
        raise TypeError(
            f"jdp.testing.with_faults: target must be a string, 'state' or 'gradients', got {target!r}."
        )
    if target not in ("state", "gradients"):
        raise ValueError(
            f"jdp.testing.with_faults: target must be 'state' or 'gradients', got {target!r}."
        )
    inner, axis_name = step.fn, step.axis_name
    if target == "gradients":
        if step.strategy.name != "exact":
            raise ValueError(
                "jdp.testing.with_faults: target='gradients' needs a step in exact mode, where "
                "each virtual replica's gradients are computed on one device; this step's "
                f"strategy is {step.strategy.name}. Build it with strategy=jdp.strategies.exact(G)."
            )

        def faulty_gradients(state: PyTree, batch: tuple[PyTree, jax.Array]):
            data, rows = _fault_batch(batch)
            return inner(state, FaultedBatch(data, rows.reshape(-1, len(FIELDS))[0]))

        return dataclasses.replace(step, fn=faulty_gradients)

    def faulty(state: PyTree, batch: tuple[PyTree, jax.Array]) -> tuple[PyTree, dict]:
        data, rows = _fault_batch(batch)
        new, metrics = inner(state, data)
        new = flip(new, rows.reshape(-1, len(FIELDS))[0], axis_name)
        view = StepView(state, new, None, _no_norm, axis_name)  # the state metrics read `after`
        makers = {**_STATE_METRICS, **({} if step.audit is None else {"audit": step.audit.metric})}
        redone = {name: make().compute(view) for name, make in makers.items() if name in metrics}
        return new, {**metrics, **redone}

    return dataclasses.replace(step, fn=faulty)


def _fault_batch(batch: object) -> tuple[PyTree, jax.Array]:
    """``(data, fault rows)`` of a faulty step's batch, refused by name in any other form."""
    usage = (
        "pass step.shard((batch, fault.rows(B))), or jdp.testing.no_fault(B) as the rows "
        "on a step without a fault (B: the global batch size)"
    )
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise TypeError(
            "jdp.testing.with_faults: a faulty step's batch is a pair (batch, fault rows); "
            f"{usage}. Got {_kind(batch)}."
        )
    data, rows = batch
    shape, dtype = getattr(rows, "shape", None), getattr(rows, "dtype", None)
    if shape is None or len(shape) != 2 or shape[1] != len(FIELDS) or dtype != jnp.int32:
        raise TypeError(
            "jdp.testing.with_faults: the second item of a faulty step's batch must be the "
            f"fault's int32 rows of {len(FIELDS)} (B, {len(FIELDS)}); {usage}. "
            f"Got shape {shape} and dtype {dtype} on one replica."
        )
    return data, rows


def _kind(x: object) -> str:
    shape = getattr(x, "shape", None)
    return (
        f"an array of shape {tuple(shape)} on one replica"
        if shape is not None
        else f"a {type(x).__name__}"
    )


def _no_norm(grads: PyTree) -> jax.Array:
    raise TypeError(
        "jdp.testing.with_faults recomputes only the state metrics; they take no gradient norm."
    )


def flip(state: PyTree, spec: jax.Array, axis_name: str) -> PyTree:
    """``state`` with the bit ``spec`` names flipped on its replica, inside a step."""
    at_step, replica, leaf, index, bit = (spec[i] for i in range(5))  # FIELDS' first five
    here = (state.step == at_step) & (lax.axis_index(axis_name) == replica)
    leaves, treedef = jax.tree.flatten(state)
    hit = [
        x if is_prng_key(x) or x.dtype == jnp.bool_ else flipped(x, here & (leaf == i), index, bit)
        for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, hit)
