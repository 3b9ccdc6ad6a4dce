"""Device-side times of a step's phases (jdp._stamps) and jdp.fit's timed steps (jdp._timed)."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import io_callback

import jdp
from jdp import _phases, _stamps
from tests import models, zoo

BATCHES = [models.regression_batch(16, seed=s) for s in range(4)]


def key_data(tree):
    return jax.tree.map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
        tree,
    )


def assert_bitwise(a, b):
    a, b = jax.tree.leaves(key_data(a)), jax.tree.leaves(key_data(b))
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)


@pytest.mark.parametrize("family", ["mlp", "cnn", "scanned_rnn", "moe_counter"])
def test_a_timed_step_computes_the_same_bits_in_exact_mode(family):
    make, state, batches = zoo.FAMILIES[family]()
    step = jdp.shard_map(make(), donate_state=False)
    twin = step.with_step(make())
    clock = _stamps.Clock()
    plain = timed = step.replicate(state)
    for batch in batches:
        plain, plain_metrics = step(plain, step.shard(batch))
        with _phases.observing(clock):
            timed, timed_metrics = twin(timed, twin.shard(batch))
        assert_bitwise((plain, plain_metrics), (timed, timed_metrics))
    jax.effects_barrier()
    assert len(clock.take(range(8))) == len(batches)


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.int32, jnp.uint32]
)
def test_the_tie_keeps_every_bit(dtype):
    special = [np.nan, np.inf, -np.inf, -0.0, 1e-40] if jnp.issubdtype(dtype, jnp.floating) else []
    x = jnp.asarray(np.r_[np.arange(-3, 5), special].astype(np.float64)).astype(dtype)

    @jax.jit
    def tied(x):
        zero = io_callback(lambda: np.zeros((), np.uint32), jax.ShapeDtypeStruct((), jnp.uint32))
        return _stamps._tie(x, zero)

    out = tied(x)
    assert out.dtype == x.dtype
    assert np.array_equal(np.asarray(out).view(np.uint8), np.asarray(x).view(np.uint8))
    assert not _stamps._tied(jnp.zeros(3, bool)) and not _stamps._tied(jax.random.key(0))
    assert not _stamps._tied(jnp.zeros((0, 3)))


def test_take_returns_the_steps_every_local_replica_finished():
    clock = _stamps.Clock()
    times = iter(np.arange(100.0))
    clock_time = functools.partial(next, times)
    stamp = functools.partial(_stamps.Clock.stamp, clock)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "perf_counter", clock_time)
        for phase in _stamps.TIMED:  # replicas 2 and 3, one step: 0, 1 / 2, 3 / 4, 5
            for replica in (2, 3):
                stamp(phase, np.int32(replica), np.uint32(0))
        stamp(_phases.START, np.int32(2), np.uint32(0))  # a second step, begun on one replica
    assert clock.take([2, 3]) == [_stamps.Timing(compute=3.0 - 0.0, collective=5.0 - 3.0)]
    assert clock.take([2, 3]) == []  # taken once; the second step is not complete


def delayed_loss(seconds, params, batch):
    """The MLP's loss, computed after a host callback that sleeps ``seconds`` on replica 0."""

    def pause(replica):
        if int(replica) == 0:
            time.sleep(seconds)
        return np.zeros((), np.float32)

    zero = jax.pure_callback(
        pause, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.axis_index("batch")
    )
    return models.mlp_loss(params, {**batch, "x": batch["x"] + zero})


def test_a_delay_in_the_loss_is_compute_not_collective():
    timings = {}
    for seconds in (0.0, 0.25):
        built = jdp.make_train_step(functools.partial(delayed_loss, seconds))
        step = jdp.shard_map(built)
        twin = step.with_step(built)
        state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1)))
        clock = _stamps.Clock()
        with _phases.observing(clock):
            for batch in BATCHES:
                state, _ = twin(state, twin.shard(batch))
        jax.block_until_ready(state)
        jax.effects_barrier()
        timings[seconds] = clock.take(range(8))[1:]  # the first call compiles
    slow = min(t.compute for t in timings[0.25])
    fast = max(t.compute for t in timings[0.0])
    assert slow >= 0.25 > fast, timings
    assert max(t.collective for t in timings[0.25]) < 0.25, timings


def fit(time_every, backend="shard_map", strategy=None, num_steps=8):
    built = jdp.make_train_step(models.mlp_loss, strategy=strategy or jdp.strategies.exact(8))
    step = models.backend(backend, built, 8)
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2)))
    data = BATCHES * 3
    return jdp.fit(
        step, state, data, num_steps=num_steps, log_every=4, time_every=time_every, progress=False
    )


def test_fit_times_every_k_steps_in_one_process_and_changes_no_bit_in_exact_mode():
    timed, history = fit(time_every=2, num_steps=12)
    plain, untimed = fit(time_every=0, num_steps=12)
    assert_bitwise(timed, plain)
    assert [row["step"] for row in history.train] == [4, 8, 12]
    assert "pace" not in history.train[0]  # the first logged step opens the first window
    for row in history.train[1:]:
        pace = row["pace"]
        assert sorted(pace) == ["collective_ms/0", "compute_ms/0", "data_ms/0", "step_ms"], pace
        assert pace["compute_ms/0"] > 0 and pace["collective_ms/0"] > 0
    assert all("pace" not in row for row in untimed.train)


def test_a_default_fit_times_nothing():
    built = jdp.make_train_step(models.mlp_loss)
    step = models.backend("shard_map", built, 8)
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1)))
    _, history = jdp.fit(step, state, BATCHES, num_steps=4, log_every=2, progress=False)
    assert all("pace" not in row for row in history.train)


@pytest.mark.parametrize(
    "time_every, error, message",
    [
        ("2", TypeError, "jdp.fit: time_every must be an int >= 0, got '2' (str)."),
        (True, TypeError, "jdp.fit: time_every must be an int >= 0, got True (bool)."),
        (None, TypeError, "jdp.fit: time_every must be an int >= 0, got None (NoneType)."),
        (-1, ValueError, "jdp.fit: time_every must be an int >= 0, got -1."),
    ],
)
def test_a_bad_time_every_is_refused_by_name(time_every, error, message):
    with pytest.raises(error) as raised:
        fit(time_every=time_every)
    assert str(raised.value) == message


def test_timing_pmap_in_one_process_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"^jdp.fit: time_every=2 times steps on jdp.shard_map"):
        fit(time_every=2, backend="pmap")
    _, history = fit(time_every=0, backend="pmap", num_steps=4)  # the fix named works
    assert [row["step"] for row in history.train] == [4]


class OwnRunner:
    """A runner of the user's own around a backend (fit takes any with the Runner methods)."""

    def __init__(self, inner):
        self.inner = inner
        self.step, self.replicate, self.shard = inner.step, inner.replicate, inner.shard

    def __call__(self, state, batch):
        return self.inner(state, batch)

    def with_step(self, step):
        return OwnRunner(self.inner.with_step(step))


def test_a_runner_of_ones_own_is_timed_only_on_request_and_then_refused():
    inner = models.backend("shard_map", jdp.make_train_step(models.mlp_loss), 8)
    step = OwnRunner(inner)
    fresh = lambda: inner.replicate(  # noqa: E731  (fit consumes the state it is given)
        jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))
    )
    _, history = jdp.fit(step, fresh(), BATCHES, num_steps=4, log_every=2, progress=False)
    assert [row["step"] for row in history.train] == [2, 4]
    with pytest.raises(TypeError) as raised:
        jdp.fit(step, fresh(), BATCHES, num_steps=4, time_every=2, progress=False)
    assert str(raised.value) == (
        "jdp.fit: time_every=2 times a step wrapped by a jdp backend (jdp.shard_map, jdp.pmap), "
        "got OwnRunner; pass time_every=0."
    )
