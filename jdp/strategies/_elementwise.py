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


Flow = tuple[bool, str | None]
"""Per value: (derived from a slice, the combining primitive it depends on or None)."""
_CLEAN: Flow = (False, None)


def check_elementwise(update_fn: Callable[..., Any], sliced: list[bool], *args: Any) -> None:
    """Refuses an update whose result depends on a reduction over a slice.

    Traces ``update_fn(*args)`` and follows every value computed by a
    reduction over a non-scalar array derived from a slice (``sliced``: per
    flattened leaf of ``args``, whether the replica holds only a slice of it)
    to the outputs. A reduction over a leaf every replica holds whole is
    exact; a ``psum`` over the data axis (as in :func:`clip_by_global_norm`)
    makes a slice's reduction global again, as an ``all_gather`` of the
    slices makes them whole.

    Raises:
      ValueError: naming the primitive, when an output depends on one.
    """
    closed = jax.make_jaxpr(update_fn)(*args)
    if len(sliced) != len(closed.jaxpr.invars):
        raise ValueError(
            f"jdp: check_elementwise got {len(sliced)} flags for {len(closed.jaxpr.invars)} inputs."
        )
    flows = _flow(closed.jaxpr, [(bool(x), None) for x in sliced])
    found = next((t for _, t in flows if t is not None), None)
    if found is not None:
        raise ValueError(
            f"jdp.strategies.zero1: the optimizer's update applies `{found}` across the "
            "elements of a split parameter or of the whole tree (global-norm clipping, "
            "LAMB/LARS trust ratios, adafactor, apply_if_finite, ...), which on a 1/n slice "
            "would give a silently different update. Use jdp.clip_by_global_norm for "
            "global-norm clipping, an elementwise optimizer, or strategies.data_parallel()."
        )


def _flow(jaxpr, inputs: list[Flow]) -> list[Flow]:
    """Per output of ``jaxpr``: whether it derives from a slice, and its taint."""
    env: dict = {}

    def read(v) -> Flow:
        return env.get(v, _CLEAN) if isinstance(v, jax_core.Var) else _CLEAN

    for v, f in zip(jaxpr.invars, inputs, strict=True):
        env[v] = f
    for eqn in jaxpr.eqns:
        flows = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        inner = _inner_jaxprs(eqn)
        # A sum over every replica's slices, or all of them gathered: global, exact.
        if name in ("psum", "all_gather"):
            outs = [_CLEAN] * len(eqn.outvars)
        elif inner:
            outs = _through_inner(eqn, inner, flows)
        else:
            merged = _merge(flows)
            combines_a_slice = name in _COMBINING and any(
                f[0] and getattr(getattr(v, "aval", None), "ndim", 0) >= 1
                for v, f in zip(eqn.invars, flows, strict=True)
            )
            outs = [(merged[0], name if combines_a_slice else merged[1])] * len(eqn.outvars)
        for v, f in zip(eqn.outvars, outs, strict=True):
            env[v] = f
    return [read(v) for v in jaxpr.outvars]


def _merge(flows: list[Flow]) -> Flow:
    return any(f[0] for f in flows), next((f[1] for f in flows if f[1] is not None), None)


def _inner_jaxprs(eqn) -> list:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax_core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jax_core.Jaxpr):
                found.append(item)
    return found


def _through_inner(eqn, inner: list, inputs: list[Flow]) -> list[Flow]:
    if len(inner) == 1 and len(inner[0].invars) == len(inputs):
        outs = _flow(inner[0], inputs)
        if len(outs) == len(eqn.outvars):
            return outs
    # Control flow: conservatively, anything inside or outside reaches every output.
    incoming = _merge(inputs)
    for jaxpr in inner:
        incoming = _merge([incoming, *_flow(jaxpr, [incoming] * len(jaxpr.invars))])
    return [incoming] * len(eqn.outvars)
