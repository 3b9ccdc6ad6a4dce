"""Collectives over the data axis inside a loss: what a micro-batch mode cannot keep.

A collective in the loss (an all-gather of embeddings for global negatives,
sync batch norm's ``pmean``) sees what the devices hold at that moment. In
the ordinary step that is the whole global batch; inside a loop over
micro-batches (exact mode's virtual replicas, ``accumulate_steps``) it is one
micro-batch per device, so the objective would change with the device count
or the number of micro-batches. Such modes trace the loss with
:func:`shape_refusing_collectives` (or :func:`refuse_collectives` on a trace
of their own) and refuse it by name.
"""

from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import core as jex_core

from jdp._tree import PyTree


def shape_refusing_collectives(
    fn: Callable[..., Any], args: tuple, axis_name: str, explain: Callable[[str], str]
) -> PyTree:
    """``jax.eval_shape(fn, *args)``; a ValueError if ``fn`` uses a collective over ``axis_name``.

    Args:
      fn: one micro-batch's computation, traced once (as ``eval_shape`` would).
      args: its arguments.
      axis_name: the data axis.
      explain: ``collective -> message`` (the mode says why and what to do).
    """
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    refuse_collectives(closed.jaxpr, axis_name, explain)
    return shape


def refuse_collectives(
    jaxpr: jex_core.Jaxpr, axis_name: str, explain: Callable[[str], str]
) -> None:
    """A ValueError, ``explain(collective)``, for the first collective over ``axis_name``."""
    found = next(collectives_over(jaxpr, axis_name), None)
    if found is not None:
        raise ValueError(explain(found))


def collectives_over(jaxpr: jex_core.Jaxpr, axis_name: str) -> Iterator[str]:
    """The names (``lax.psum``, ``lax.all_gather``, ...) of collectives over ``axis_name``."""
    for eqn in jaxpr.eqns:
        for key in ("axes", "axis_name"):
            names = eqn.params.get(key)
            if axis_name in (names if isinstance(names, (tuple, list)) else (names,)):
                yield f"lax.{eqn.primitive.name}"
        for sub in jex_core.jaxprs_in_params(eqn.params):
            yield from collectives_over(sub, axis_name)
