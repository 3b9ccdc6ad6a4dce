"""Per-call cost: a tiny, dispatch-bound model, where a step costs what its call costs.

Notebook experiments often train models this small, so anything jdp adds per
call shows. Each row times the jdp step against references measured in the
same process, in alternated rounds of 300 steps (15 rounds):

  n = 1: jdp.pmap and jdp.shard_map against ``jax.jit`` of the same
    per-replica step on the same jdp.TrainState (what jdp adds to a call),
    and, for scale, a Flax ``TrainState`` step and a bare (params, opt_state)
    step, both plain ``jax.jit``;
  n = 8: jdp.shard_map and jdp.pmap against a hand-written
    ``jax.jit(jax.shard_map(...))`` step on the same jdp.TrainState, and a
    bare one.

A ratio is the reference's time over jdp's: 1.0 means the same rate. Each
round times every step back to back, so a ratio is taken within a round
(the machine's load moves between rounds, not within one) and the median of
the rounds' ratios is printed, with the middle half of them.
"""

import statistics
import time

import jdp

jdp.force_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROUNDS, STEPS = 15, 300
TX = optax.sgd(0.01)


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def host_batch(n):
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(8 * n, 4)).astype(np.float32),
        "y": rng.normal(size=(8 * n, 1)).astype(np.float32),
    }


def fresh_state():
    return jdp.TrainState.create(params={"w": jnp.zeros((4, 1))}, tx=TX)


class Runner:
    """Calls ``fn(state, batch) -> (state, metrics)`` in a loop, keeping the state."""

    def __init__(self, fn, state, batch):
        self.fn, self.state, self.batch = fn, state, batch

    def run(self, steps):
        fn, state, batch = self.fn, self.state, self.batch
        start = time.perf_counter()
        for _ in range(steps):
            state, _ = fn(state, batch)
        jax.block_until_ready(state)
        self.state = state
        return (time.perf_counter() - start) / steps


def same_state_step(mesh):
    """The per-replica body a user would write, on jdp's TrainState, jitted by hand."""

    def per_replica(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        grads = jax.lax.pmean(grads, "batch")
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new, {"loss": loss[None]}

    mapped = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(P(), P("batch")),
        out_specs=(P(), P("batch")),
        check_vma=False,
    )
    return jax.jit(mapped, donate_argnums=0)


def bare_step(mesh):
    def per_replica(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = TX.update(jax.lax.pmean(grads, "batch"), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss[None]

    mapped = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(P(), P(), P("batch")),
        out_specs=(P(), P(), P("batch")),
        check_vma=False,
    )
    fn = jax.jit(mapped, donate_argnums=(0, 1))
    return lambda s, b: (lambda p, o, loss: ((p, o), loss))(*fn(*s, b))


def flax_step():
    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return jax.jit(step, donate_argnums=0)


def runners(n):
    devices = jax.devices()[:n]
    mesh = Mesh(np.asarray(devices), ("batch",))
    host = host_batch(n)
    placed = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
    out = {}
    for name, wrap in [("jdp.pmap", jdp.pmap), ("jdp.shard_map", jdp.shard_map)]:
        kwargs = {"devices": devices} if wrap is jdp.pmap else {"mesh": mesh}
        step = wrap(jdp.make_train_step(loss_fn), **kwargs)
        out[name] = Runner(step, step.replicate(fresh_state()), step.shard(host))
    out["same state, hand jit"] = Runner(
        same_state_step(mesh), placed(fresh_state(), P()), placed(host, P("batch"))
    )
    params = {"w": jnp.zeros((4, 1))}
    out["bare (params, opt_state)"] = Runner(
        bare_step(mesh), placed((params, TX.init(params)), P()), placed(host, P("batch"))
    )
    if n == 1:  # its own params: the others' were donated
        flax = train_state.TrainState.create(apply_fn=None, params={"w": jnp.zeros((4, 1))}, tx=TX)
        out["Flax TrainState"] = Runner(flax_step(), flax, jax.device_put(host, devices[0]))
    return out


def main():
    print(__doc__.split("\n\n")[0])
    print(f"JAX {jax.__version__}; {ROUNDS} alternated rounds x {STEPS} steps\n")
    for n in (1, 8):
        found = runners(n)
        for r in found.values():
            r.run(50)  # compile and warm up
        times: dict[str, list[float]] = {name: [] for name in found}
        for _ in range(ROUNDS):
            for name, r in found.items():
                times[name].append(r.run(STEPS))
        print(f"n = {n}: microseconds per step (median), and reference time / jdp time")
        for name, t in times.items():
            print(f"  {name:<26} {statistics.median(t) * 1e6:8.1f} us")
        for jdp_name in ("jdp.pmap", "jdp.shard_map"):
            refs = [k for k in times if not k.startswith("jdp.")]
            ratios = ", ".join(f"{k}: {_ratio(times[k], times[jdp_name])}" for k in refs)
            print(f"  {jdp_name} ratios -> {ratios}")
        print()


def _ratio(reference: list[float], timed: list[float]) -> str:
    """The median of the per-round ratios, with their interquartile range."""
    per_round = sorted(r / t for r, t in zip(reference, timed, strict=True))
    q1, median, q3 = statistics.quantiles(per_round, n=4)
    return f"{median:.3f} [{q1:.3f}-{q3:.3f}]"


if __name__ == "__main__":
    main()
