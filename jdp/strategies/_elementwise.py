"""The trace-time check that an optimizer update is elementwise, for zero1.

A transform that reduces over a leaf or over the tree (global-norm clipping,
LAMB/LARS trust ratios, adafactor) would see only a slice under weight-update
sharding and silently compute another update; this check finds such a
reduction in the update's jaxpr and refuses it.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jax_core

# Primitives that combine several elements of an array: applied to a slice,
# they give another result than on the whole leaf.
_COMBINING = {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "reduce",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
    "sort",
    "top_k",
    "dot_general",
    "transpose",
    "rev",
    "fft",
}


def check_elementwise(update_fn: Callable[..., Any], *args: Any) -> None:
    """Refuses an update whose result depends on a reduction over a slice.

    Traces ``update_fn(*args)`` (inside a sharded update) and follows every
    value computed by a reduction over a non-scalar array to the outputs; a
    ``psum`` over the data axis (as in :func:`clip_by_global_norm`) makes it
    global again.

    Raises:
      ValueError: naming the primitive, when an output depends on one.
    """
    closed = jax.make_jaxpr(update_fn)(*args)
    culprit = _tainted_outputs(closed.jaxpr, [None] * len(closed.jaxpr.invars))
    found = next((c for c in culprit if c is not None), None)
    if found is not None:
        raise ValueError(
            f"shard_optimizer=True: the optimizer's update applies `{found}` across the "
            "elements of a parameter or of the whole tree (global-norm clipping, LAMB/LARS "
            "trust ratios, adafactor, apply_if_finite, ...), which on a 1/n slice would give "
            "a silently different update. Use jdp.clip_by_global_norm for global-norm "
            "clipping, an elementwise optimizer, or shard_optimizer=False."
        )


def _tainted_outputs(jaxpr, taints: list) -> list:
    """Per output: the combining primitive it depends on (not yet psum'd), or None."""
    env: dict = {}

    def read(v):
        return env.get(v) if isinstance(v, jax_core.Var) else None

    for v, t in zip(jaxpr.invars, taints, strict=True):
        env[v] = t
    for eqn in jaxpr.eqns:
        inputs = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        inner = _inner_jaxprs(eqn)
        if name == "psum":
            outs = [None] * len(eqn.outvars)
        elif inner:
            outs = _through_inner(eqn, inner, inputs)
        elif name in _COMBINING and any(
            getattr(getattr(v, "aval", None), "ndim", 0) >= 1 for v in eqn.invars
        ):
            outs = [name] * len(eqn.outvars)
        else:
            t = next((t for t in inputs if t is not None), None)
            outs = [t] * len(eqn.outvars)
        for v, t in zip(eqn.outvars, outs, strict=True):
            env[v] = t
    return [read(v) for v in jaxpr.outvars]


def _inner_jaxprs(eqn) -> list:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax_core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jax_core.Jaxpr):
                found.append(item)
    return found


def _through_inner(eqn, inner: list, inputs: list) -> list:
    if len(inner) == 1 and len(inner[0].invars) == len(inputs):
        outs = _tainted_outputs(inner[0], inputs)
        if len(outs) == len(eqn.outvars):
            return outs
    # Control flow: conservatively, any taint inside or outside reaches every output.
    incoming = next((t for t in inputs if t is not None), None)
    for jaxpr in inner:
        seed = [incoming] * len(jaxpr.invars)
        incoming = incoming or next((t for t in _tainted_outputs(jaxpr, seed) if t), None)
    return [incoming] * len(eqn.outvars)
