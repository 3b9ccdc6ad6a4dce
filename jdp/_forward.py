"""The loss contract: one (micro-)batch's loss, gradients, model state and aux.

What a step computes before any collective: the loss function is called under
the precision policy and the loss scale, its output is checked against the
contract (``has_aux``, ``has_model_state``, plain or weighted loss), and its
gradients are taken. :func:`accumulate` sums micro-batches. Strategies
(``jdp.strategies``) decide how these contributions cross replicas.
"""

import inspect
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from jdp import _tree
from jdp._batching import AXIS_NAME, batch_size
from jdp._collectives import shape_refusing_collectives
from jdp._precision import Policy
from jdp._state import TrainState
from jdp._tree import PyTree
from jdp._weighting import WeightedLoss, safe_divide, zero_where_weightless


class Contribution(NamedTuple):
    """One replica's (or micro-batch's) contribution, before any collective.

    ``grads`` is the gradient of the scaled loss: of the summed ``total`` for a
    :class:`jdp.WeightedLoss` (``weight`` its weight), of the mean loss for a
    plain scalar (``weight`` None). ``aux`` holds the aux metrics.
    """

    grads: PyTree
    total: jax.Array
    weight: jax.Array | None
    model_state: PyTree
    aux: dict[str, jax.Array]


class Forward(Protocol):
    """``(state, params, model_state, micro_batch, rng) -> Contribution``.

    Keywords: ``view``, a function of the differentiated ``params`` giving
    what the loss is called with (a strategy that splits the parameters
    gathers them there; by default the params themselves), and
    ``zero_weightless``, whether a replica of weight 0 contributes exact
    zeros (True; a strategy whose gradients are already summed over replicas
    when the forward returns passes False).
    """

    def __call__(
        self,
        state: TrainState,
        params: PyTree,
        model_state: PyTree,
        batch: PyTree,
        rng: "jax.Array | None",
        /,
        view: Callable[[PyTree], PyTree] = ...,
        zero_weightless: bool = ...,
    ) -> Contribution: ...


def _same(params: PyTree) -> PyTree:
    return params


def replica_rng(key: jax.Array, step: jax.Array, axis_name: str = AXIS_NAME) -> jax.Array:
    """A key distinct per replica and step, deterministic in (key, step, replica).

    Use inside a step, under a backend that binds ``axis_name``.
    """
    return jax.random.fold_in(jax.random.fold_in(key, step), lax.axis_index(axis_name))


def make_forward(
    loss_fn: Callable[..., Any], policy: Policy, has_aux: bool, has_model_state: bool, has_rng: bool
) -> Forward:
    """``(state, params, model_state, batch, rng) -> Contribution`` for one (micro-)batch."""

    def forward(
        state, params, model_state, batch, rng, view=_same, zero_weightless=True
    ) -> Contribution:
        def scaled_loss(p):
            extra = {}
            if has_model_state:
                extra["model_state"] = model_state
            if has_rng:
                extra["rng"] = rng
            out = loss_fn(policy.cast_params(view(p)), policy.cast_batch_leaves(batch), **extra)
            loss, new_model_state, aux = _unpack(out, has_aux, has_model_state)
            if has_model_state:
                check_model_state(new_model_state, model_state, "jdp.make_train_step: loss_fn")
            check_aux(aux)
            if isinstance(loss, WeightedLoss):
                total, weight = loss.total.astype(jnp.float32), loss.weight.astype(jnp.float32)
            else:
                total, weight = loss.astype(jnp.float32), None
            return state.loss_scale.scale(total), (total, weight, new_model_state, aux)

        (_, (total, weight, new_model_state, aux)), grads = jax.value_and_grad(
            scaled_loss, has_aux=True
        )(params)
        aux = {k: jnp.asarray(v).astype(jnp.float32) for k, v in aux.items()}
        if zero_weightless:
            grads = zero_where_weightless(grads, weight)
        return Contribution(grads, total, weight, new_model_state, aux)

    return forward


def accumulate(
    forward: Forward,
    state: TrainState,
    batch: PyTree,
    rng: jax.Array | None,
    steps: int,
    axis_name: str = AXIS_NAME,
    probe: Forward | None = None,
) -> Contribution:
    """This replica's contribution, summed over ``steps`` micro-batches.

    A weighted loss sums totals, gradients and weighted aux over micro-batches
    (a micro-batch of weight 0 leaves the model state alone); a plain loss
    averages them. A loss with a collective over ``axis_name`` is refused
    (each micro-batch's collective would see only that micro-batch); the
    loss is traced for that through ``probe`` (default ``forward``), which a
    strategy whose forward has collectives of its own gives without them.
    """
    params, model_state = state.params, state.model_state
    if steps == 1:
        return forward(state, params, model_state, batch, rng)
    micro = _micro_batches(batch, steps)

    def body(carry, inputs):
        grads, total, weight, model_state, aux = carry
        index, micro_batch = inputs
        key = None if rng is None else jax.random.fold_in(rng, index)
        out = forward(state, params, model_state, micro_batch, key)
        w = jnp.float32(1.0) if out.weight is None else out.weight
        if out.weight is not None:
            model_state = jax.tree.map(
                lambda new, old: jnp.where(w > 0, new, old), out.model_state, model_state
            )
        else:
            model_state = out.model_state
        aux = {k: aux[k] + zero_where_weightless(v * w, out.weight) for k, v in out.aux.items()}
        carry = (
            jax.tree.map(jnp.add, grads, out.grads),
            total + zero_where_weightless(out.total, out.weight),
            weight + w,
            model_state,
            aux,
        )
        return carry, None

    first_micro = jax.tree.map(lambda x: x[0], micro)
    traced = forward if probe is None else probe
    first = shape_refusing_collectives(
        lambda b: traced(state, params, model_state, b, rng),
        (first_micro,),
        axis_name,
        partial(_accumulation_refusal, steps=steps, axis_name=axis_name),
    )
    init = (
        jax.tree.map(jnp.zeros_like, params),
        jnp.float32(0.0),
        jnp.float32(0.0),
        model_state,
        {k: jnp.zeros(jnp.shape(v), jnp.float32) for k, v in first.aux.items()},
    )
    (grads, total, weight, model_state, aux), _ = lax.scan(body, init, (jnp.arange(steps), micro))
    aux = {k: safe_divide(v, weight) for k, v in aux.items()}
    if first.weight is None:
        return Contribution(
            jax.tree.map(lambda g: g / steps, grads), total / steps, None, model_state, aux
        )
    return Contribution(grads, total, weight, model_state, aux)


def _unpack(out: Any, has_aux: bool, has_model_state: bool):
    expected = {
        (False, False): "loss",
        (True, False): "(loss, aux)",
        (False, True): "(loss, new_model_state)",
        (True, True): "(loss, (new_model_state, aux))",
    }[(has_aux, has_model_state)]
    if isinstance(out, tuple) and not (has_aux or has_model_state):
        raise TypeError(
            f"jdp.make_train_step: loss_fn returned a tuple of {len(out)}, but the step expects a bare loss. If it "
            "returns (loss, aux), build the step with has_aux=True; (loss, new_model_state): "
            "has_model_state=True; (loss, (new_model_state, aux)): both."
        )
    loss, model_state, aux = out, None, {}
    try:
        if has_aux or has_model_state:
            loss, rest = out
            if has_aux and has_model_state:
                model_state, aux = rest
            elif has_aux:
                aux = rest
            else:
                model_state = rest
    except (TypeError, ValueError):
        raise TypeError(
            f"jdp.make_train_step: loss_fn must return {expected} (has_aux={has_aux}, "
            f"has_model_state={has_model_state}); got {type(out).__name__}."
        ) from None
    _check_loss(loss)
    if not isinstance(aux, Mapping):
        raise TypeError(
            f"jdp.make_train_step: with has_aux=True, aux must be a dict of arrays (it joins the "
            f"metrics), got {type(aux).__name__}."
        )
    return loss, model_state, aux


def check_call(fn: Callable[..., Any], extra: tuple[str, ...], where: str, what: str) -> None:
    """Refuses, when it is built, a function the step cannot call as ``fn(params, batch, **extra)``."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: the call itself will tell
        return
    parameters = signature.parameters.values()
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    for name in extra:
        if not takes_any and name not in signature.parameters:
            flag = "has_model_state" if name == "model_state" else "has_rng"
            raise TypeError(
                f"{where}({flag}=True) calls {what}(params, batch, {name}=...) by keyword, but "
                f"{what} takes {signature}: name that parameter {name}."
            )
    try:
        signature.bind(None, None, **dict.fromkeys(extra))
    except TypeError as e:
        missing = [
            n for n in ("model_state", "rng") if n in signature.parameters and n not in extra
        ]
        hint = (
            f"build the step with has_{missing[0]}=True"
            if missing and "missing" in str(e)
            else "give the others defaults or bind them with functools.partial"
        )
        passed = "".join(f", {n}=..." for n in extra)
        raise TypeError(
            f"{where}: {what}{signature} cannot be called as {what}(params, batch{passed}) "
            f"({e}); {hint}."
        ) from None


def check_model_state(new: PyTree, old: PyTree, what: str) -> None:
    """The model state a loss returns has the structure, shapes and dtypes it was given."""
    new_paths, new_def = _tree.flatten_with_path(new)
    old_paths, old_def = _tree.flatten_with_path(old)
    if new_def != old_def:
        hint = ""
        if type(new).__module__.startswith("flax"):
            hint = " (an NNX loss returns jdp.nnx.state(model, model_state), not the module)"
        raise ValueError(
            f"{what} returned a model state of another structure than state.model_state"
            f"{hint}: got {new_def!s:.200}, expected {old_def!s:.200}. Return the updated "
            "model state with the same keys (e.g. Flax Linen's mutated['batch_stats'])."
        )
    for (path, x), (_, y) in zip(new_paths, old_paths, strict=True):
        if jnp.shape(x) != jnp.shape(y) or jnp.result_type(x) != jnp.result_type(y):
            raise TypeError(
                f"{what} returned model state leaf {jax.tree_util.keystr(path)} as "
                f"{jnp.result_type(x)}{list(jnp.shape(x))}, but state.model_state holds "
                f"{jnp.result_type(y)}{list(jnp.shape(y))}: return it in the same shape and "
                "dtype (e.g. .astype(old.dtype)), or create the state with the new one."
            )


def check_aux(aux: Mapping[str, Any]) -> None:
    """Aux values are numeric arrays (each replica's mean, averaged across replicas)."""
    for key, value in aux.items():
        if not isinstance(key, str):
            raise TypeError(
                f"jdp.make_train_step: aux keys name metrics and must be strings, got {key!r}."
            )
        if isinstance(value, (str, bytes)) or not (
            hasattr(value, "dtype") or isinstance(value, (int, float, bool))
        ):
            raise TypeError(
                f"jdp.make_train_step: aux[{key!r}] is a {type(value).__name__} ({value!r:.40}); aux values are "
                "numeric arrays that join the metrics. Log text and objects outside the step."
            )


def _check_loss(loss: Any) -> None:
    if isinstance(loss, WeightedLoss):
        for field in ("total", "weight"):
            value = getattr(loss, field)
            if not isinstance(value, jax.Array) or value.ndim != 0:
                raise ValueError(
                    f"jdp.WeightedLoss.{field} must be a scalar array, got shape "
                    f"{jnp.shape(value)}; sum over the batch, e.g. jdp.weighted_mean(values, mask)."
                )
        if not jnp.issubdtype(loss.total.dtype, jnp.floating):
            raise TypeError(
                f"jdp.WeightedLoss.total must be floating, got dtype {loss.total.dtype}."
            )
        return
    if isinstance(loss, (int, float)):
        raise TypeError(
            f"jdp.make_train_step: loss_fn returned a Python {type(loss).__name__} ({loss!r}); the loss must be "
            "a JAX scalar computed from params (a constant has no gradient)."
        )
    if not isinstance(loss, jax.Array) or loss.ndim != 0:
        raise ValueError(
            f"jdp.make_train_step: loss_fn must return a scalar loss, got shape {jnp.shape(loss)}. "
            "Reduce it over the batch, e.g. jnp.mean(per_example_loss), or return "
            "jdp.weighted_mean(per_example_loss, mask)."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            f"jdp.make_train_step: loss_fn must return a floating loss, got dtype {loss.dtype}."
        )


def _micro_batches(batch: PyTree, steps: int) -> PyTree:
    """``(B, ...)`` -> ``(steps, B / steps, ...)``."""
    size = batch_size(batch, "jdp.make_train_step: the batch")
    if size % steps:
        raise ValueError(
            f"jdp.make_train_step: accumulate_steps={steps} does not divide the per-replica "
            f"batch of {size} examples. Use a global batch divisible by "
            f"accumulate_steps x number of devices."
        )
    return jax.tree.map(lambda x: x.reshape((steps, x.shape[0] // steps) + x.shape[1:]), batch)


def _accumulation_refusal(collective: str, steps: int, axis_name: str) -> str:
    return (
        f"jdp: the loss calls {collective} over the data axis "
        f"{axis_name!r}, which under "
        f"accumulate_steps={steps} runs once per micro-batch and sees only that micro-batch of "
        "every device, not the global batch: the objective would change with accumulate_steps. "
        "Use accumulate_steps=1 (a collective in the loss then sees the whole global batch, as "
        "single-device training does), or a loss without collectives (e.g. batch norm without "
        "axis_name)."
    )
