"""Spare states: jdp.fit under jdp.shard_map writes each new state into one the survivors'
copy let go of (ShardMapStep.call_into), trains the same bits, and never writes into a state
that anything outside the loop may hold."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp import _recycle, _standby
from jdp.backends import ShardMapStep
from tests import models

DATA = models.regression_batch(96, seed=5)
STEPS = 14  # 6 steps an epoch: two epoch ends, two saves (every 5)


def fit(tmp_path, donate, strategy=None, on_epoch_end=None, saved=None):
    train_step = jdp.make_train_step(models.mlp_loss, strategy=strategy)
    step = models.backend("shard_map", train_step, 8, donate_state=None if donate else False)
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2)))
    local = None if donate else tmp_path / "local"
    with jdp.Checkpointer(tmp_path / "ckpt", local_directory=local, async_save=True) as ckpt:
        if saved is not None:
            save = ckpt.save
            ckpt.save = lambda s, st, **kw: (saved.append(st), save(s, st, **kw))[1]
        out, _ = jdp.fit(
            step,
            state,
            jdp.BatchIterator(DATA, 16, seed=2),
            num_steps=STEPS,
            checkpointer=ckpt,
            checkpoint_every=5,
            on_epoch_end=on_epoch_end,
            progress=False,
        )
    return step, state, out


def record_calls(monkeypatch):
    """Each call_into's (spare, the new state's arrays), recorded."""
    calls = []
    call_into = ShardMapStep.call_into

    def spy(self, state, batch, spare):
        new, metrics = call_into(self, state, batch, spare)
        calls.append((spare, _recycle._Arrays(new).arrays))
        return new, metrics

    monkeypatch.setattr(ShardMapStep, "call_into", spy)
    return calls


def host(tree):
    return [np.array(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("strategy", [None, "zero1"])
def test_fit_writes_each_state_into_an_older_one_and_trains_the_same_bits(
    tmp_path, monkeypatch, strategy
):
    make = {None: lambda: None, "zero1": jdp.strategies.zero1}[strategy]
    _, _, expected = fit(tmp_path / "donating", donate=True, strategy=make())
    calls = record_calls(monkeypatch)
    step, _, out = fit(tmp_path / "kept", donate=False, strategy=make())
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        assert np.array_equal(a, b)
    assert len(calls) == STEPS
    outputs = {id(x) for _, new in calls for x in new}
    recycled = [all(id(x) in outputs for x in spare) for spare, _ in calls]
    assert all(x.is_deleted() for spare, _ in calls for x in spare)
    # The first two steps have nothing older to write into; later ones do, except
    # after a save (its state is protected) or when two states were let go of at once.
    assert not any(recycled[:2]) and sum(recycled) >= 3
    assert step._fn_into._cache_size() == 1  # the spares never change what is compiled


def test_states_code_outside_the_loop_holds_are_never_written_into(tmp_path, monkeypatch):
    hooked, saved = [], []

    def on_epoch_end(epoch, state):
        hooked.append((state, host(state)))

    calls = record_calls(monkeypatch)
    _, start, _ = fit(tmp_path, donate=False, on_epoch_end=on_epoch_end, saved=saved)
    assert len(hooked) == 2 and len(saved) == 3  # steps 5, 10 and the last
    donated = {id(x) for spare, _ in calls for x in spare}
    for state in [start, *(s for s, _ in hooked), *saved]:
        assert not any(id(x) in donated for x in jax.tree.leaves(state))
    for state, values in hooked:  # read back: intact, as the hook saw them
        assert all(np.array_equal(a, b) for a, b in zip(host(state), values, strict=True))


class Forwarding:
    """A backend stand-in whose step returns its ``frozen`` leaf unchanged and as a metric.

    It deletes what it is given to write into, as a donating XLA call does.
    """

    recycles = True

    def __init__(self):
        self.spares = []

    def call_into(self, state, batch, spare):
        self.spares.append(spare)
        for x in spare:
            x.delete()
        new = {"frozen": state["frozen"], "w": state["w"] + batch}
        return new, {"seen": state["frozen"]}


def test_a_leaf_a_step_returns_unchanged_is_never_written_into(tmp_path):
    runner, standby = Forwarding(), _standby.Standby(tmp_path, 0)
    state = {"frozen": jnp.arange(3.0), "w": jnp.zeros(3)}
    spares = _recycle.Spares(runner, standby, {"frozen": jnp.ones(3), "w": jnp.ones(3)})
    metrics = []
    for step in range(1, 9):
        state, m = spares(state, jnp.ones(3))
        metrics.append(m)
        jax.block_until_ready(state)
        standby.keep(step, state, None, None)
    frozen = state["frozen"]
    assert not frozen.is_deleted() and np.array_equal(frozen, np.arange(3.0))
    assert not any(id(x) == id(frozen) for spare in runner.spares for x in spare)
    assert all(not m["seen"].is_deleted() for m in metrics)
    assert np.array_equal(state["w"], np.full(3, 8.0))
    # Every w but the first two steps' came from a state the copy let go of.
    assert sum(spare[1].is_deleted() for spare in runner.spares[2:]) == 6


@pytest.mark.parametrize("backend, donate", [("pmap", False), ("shard_map", None)])
def test_call_into_is_refused_where_it_cannot_write_into_the_spare(backend, donate):
    step = models.backend(backend, jdp.make_train_step(models.mlp_loss), 8, donate_state=donate)
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1)))
    spare = [jnp.zeros_like(x) for x in _recycle._Arrays(state).arrays]
    with pytest.raises(
        ValueError, match=r"call_into needs a backend that recycles .* donate_state=False"
    ):
        step.call_into(state, step.shard(DATA), spare)
    assert not any(x.is_deleted() for x in spare)
