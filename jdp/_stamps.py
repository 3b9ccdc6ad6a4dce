"""Device-side times of a step's phases: where a process computes and where it waits.

In a synchronous step every process waits for the slowest inside the first
collective, so every process's step takes as long on the host. Seen from the
device, the phases tell them apart: the slow process computes long and waits
little in the reduction, its peers the other way round. A step traced inside
``jdp._phases.observing(clock)`` calls the host at its start, after each
replica's contribution (before any collective) and after the reduction, and
the host notes the time (:class:`Clock`).

Each stamp is an ``io_callback`` that returns a zero, and the zero is added
to the integer bits of the values the next phase consumes: the device cannot
start that phase before the stamp, and the sum keeps every bit. (A
``jax.debug.callback`` has no result to depend on: XLA ran the reduction
before the stamp, and both processes read the same compute time. An
``optimization_barrier`` as the only dependency was dropped the same way.)
"""

import dataclasses
import functools
import threading
import time
from collections.abc import Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from jdp import _phases

T = TypeVar("T")
TIMED = (_phases.START, _phases.FORWARD, _phases.REDUCTION)
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@dataclasses.dataclass(frozen=True)
class Timing:
    """One timed step on this process, in seconds.

    Attributes:
      compute: from the first of its devices starting the step to the last
        one's contribution being ready (forward and backward passes, before
        any collective).
      collective: from then to the last device's stamp after the reduction:
        the time spent waiting for the peers and reducing, and whatever
        XLA scheduled before that stamp (often the update).
    """

    compute: float
    collective: float


class Clock:
    """The host's side of the stamps: the time each local replica reached each phase.

    Stamps come in per replica in step order; a step is complete when every
    local replica stamped every phase of it (:meth:`take`, which lets go of
    the stamps it returns).
    """

    def __init__(self) -> None:
        self._stamps: dict[str, dict[int, list[float]]] = {p: {} for p in TIMED}
        self._lock = threading.Lock()

    def stamp(self, phase: str, replica: np.ndarray, _ready: np.ndarray) -> np.ndarray:
        """The callback: notes the time, returns the zero the next phase waits for."""
        now = time.perf_counter()
        with self._lock:
            self._stamps[phase].setdefault(int(replica), []).append(now)
        return np.zeros((), np.uint32)

    def observe(self, phase: str, tree: T, axis_name: str, split: list[bool], rows: bool) -> T:
        """Stamps the phase once ``tree`` is computed; ties ``tree`` to the stamp before a collective.

        The reduced result is not tied: outside exact mode the update that
        consumes it compiled differently, with other last bits (7 of 13 zoo
        families against 3 untied), so its stamp runs where XLA schedules
        it after the reduction, often after the update.
        """
        if phase not in TIMED:
            return tree
        leaves, structure = jax.tree.flatten(tree)
        tied = [i for i, x in enumerate(leaves) if _tied(x)]
        # The stamp waits for every leaf.
        ready = lax.optimization_barrier([leaves[i] for i in tied])
        zero = io_callback(
            functools.partial(self.stamp, phase),
            jax.ShapeDtypeStruct((), jnp.uint32),
            lax.axis_index(axis_name),
            _ready(ready),
            ordered=False,
        )
        if phase == _phases.REDUCTION:
            return tree
        # Behind a barrier, the tied values reach the next phase as whole
        # buffers, like its own inputs: fused into it, they changed how XLA
        # emitted a loss's reduction (its last bits, in tests).
        out = lax.optimization_barrier([_tie(x, zero) for x in ready])
        for i, x in zip(tied, out, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(structure, leaves)

    def take(self, replicas: Sequence[int]) -> list[Timing]:
        """The steps every one of ``replicas`` (this process's) completed since the last call."""
        with self._lock:
            lists = {p: [self._stamps[p].setdefault(r, []) for r in replicas] for p in TIMED}
            done = min((len(times) for each in lists.values() for times in each), default=0)
            if done == 0:
                return []
            stamps = {p: np.array([times[:done] for times in each]) for p, each in lists.items()}
            for each in lists.values():
                for times in each:
                    del times[:done]
        start, ready, reduced = (stamps[p] for p in TIMED)
        first, last_ready = start.min(axis=0), ready.max(axis=0)
        return [
            Timing(float(c), float(w))
            for c, w in zip(last_ready - first, reduced.max(axis=0) - last_ready, strict=True)
        ]


def _ready(leaves: Sequence[jax.Array]) -> jax.Array:
    """A scalar computed from every leaf (so the stamp runs after all of them)."""
    words = [_bits(x.reshape(-1)[:1]).astype(jnp.uint32)[0] for x in leaves]
    return sum(words, jnp.zeros((), jnp.uint32))


def _tied(x: object) -> bool:
    """Whether ``x`` is a non-empty array of floats or integers (not a key, a bool or a complex)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not getattr(x, "size", 0):
        return False
    return bool(jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))


def _bits(x: jax.Array) -> jax.Array:
    """``x``'s integer bits (an integer array is its own)."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x
    return lax.bitcast_convert_type(x, _UNSIGNED[jnp.dtype(x.dtype).itemsize])


def _tie(x: jax.Array, zero: jax.Array) -> jax.Array:
    """``x``, bit for bit, computed only once ``zero`` (always 0) is known."""
    bits = _bits(x)
    tied = bits + zero.astype(bits.dtype)
    return tied if tied.dtype == x.dtype else lax.bitcast_convert_type(tied, x.dtype)
