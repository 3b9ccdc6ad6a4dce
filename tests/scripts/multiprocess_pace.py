"""A job with a slow or a hung process, for tests/test_pace.py and benchmarks/pace.py.

python tests/scripts/multiprocess_pace.py MODE STEPS SLOWDOWN [TIME_EVERY [BACKEND]]   (under jdp.launch, ...)

Trains an MLP of 2.1M parameters with fit, logging every 10 steps and timing
every TIME_EVERY steps on the device (default 0: none), under BACKEND
(``pmap``, the default, or ``shard_map``); process 0 prints its last row's
``pace`` to stderr at the end. MODE:

- ``slow``: from step 21 the last process's data loader sleeps SLOWDOWN times
  its own mean step time over steps 11-20 before each batch (0.1: 10% slower;
  steps 1-10 hold the compilations of the step and of a timed twin);
- ``slow-loss``: the same sleep, from step 21, inside the last process's loss
  (a host callback whose result the loss uses): its device computes longer;
- ``clean``: no process sleeps;
- ``hang-data``: the last process's data loader blocks for good before the
  batch of step 8, while its Python (and jdp's watchdog) stays alive;
- ``hang-step``: inside the step of step 8, the last process's loss calls a
  host callback that blocks for good: its step never reaches the all-reduce
  the others wait in.
"""

import itertools
import json
import sys
import threading
import time

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402

SIZES = (512, 1024, 1024, 512)
FOREVER = threading.Event()  # never set: a wait that does not end, the process alive
DELAY = [0.0]  # seconds the last process's loss sleeps in mode slow-loss (set at step 21)


def hang(*_):
    print(f"hanging at {time.time()}", file=sys.stderr, flush=True)
    FOREVER.wait()


def params():
    r = np.random.RandomState(0)
    return [
        jnp.asarray(r.randn(a, b) / np.sqrt(a), jnp.float32) for a, b in itertools.pairwise(SIZES)
    ]


def slow(_step):
    time.sleep(DELAY[0])
    return np.zeros((), np.float32)


def loss(ws, batch, hang_at=None, slowed=False):
    h = batch["x"]
    if hang_at is not None:  # the last process's host callback blocks at that step
        jax.debug.callback(lambda s: hang() if int(s) == hang_at else None, batch["step"][0])
    if slowed:  # the loss waits for the callback's zero: the device's compute takes longer
        h = h + jax.pure_callback(slow, jax.ShapeDtypeStruct((), jnp.float32), batch["step"][0])
    for w in ws[:-1]:
        h = jnp.tanh(h @ w)
    return jnp.mean((h @ ws[-1] - batch["y"]) ** 2)


def batches(mode, last, slowdown):
    r = np.random.RandomState(jax.process_index())
    x = r.randn(64, SIZES[0]).astype(np.float32)
    y = r.randn(64, SIZES[-1]).astype(np.float32)
    times = []
    for step in range(1, 10**9):
        times.append(time.perf_counter())
        if mode == "slow" and last and step > 20:
            time.sleep(slowdown * (times[20] - times[10]) / 10)
        if mode == "slow-loss" and last and step == 21:
            DELAY[0] = slowdown * (times[20] - times[10]) / 10
        if mode == "hang-data" and last and step == 8:
            hang()
        yield {"x": x, "y": y, "step": np.full(64, step, np.int32)}


def main(mode, steps, slowdown, time_every, backend):
    last = jax.process_index() == jax.process_count() - 1
    hang_at = 8 if mode == "hang-step" and last else None
    slowed = mode == "slow-loss" and last
    wrap = {"pmap": jdp.pmap, "shard_map": jdp.shard_map}[backend]
    step = wrap(jdp.make_train_step(lambda w, b: loss(w, b, hang_at, slowed)))
    state = step.replicate(jdp.TrainState.create(params=params(), tx=optax.adam(1e-4)))
    _, history = jdp.fit(
        step,
        state,
        batches(mode, last, slowdown),
        num_steps=steps,
        log_every=10,
        time_every=time_every,
        progress=False,
    )
    if jax.process_index() == 0:  # its rows carry every process's data wait
        print("pace", json.dumps(history.train[-1].get("pace")), file=sys.stderr, flush=True)
    print("finished", jax.process_index(), flush=True)


if __name__ == "__main__":
    given = sys.argv[4:6]
    time_every, backend = [*given, *("0", "pmap")[len(given) :]]
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(time_every), backend)
