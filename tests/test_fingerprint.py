"""The state fingerprint: order-free, the same for every layout, and changed by any one bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp.metrics import state_fingerprint
from tests import models

DATA = [models.regression_batch(32, seed=900 + i) for i in range(3)]


def initial_state():
    return jdp.TrainState.create(params=models.mlp_params(hidden=13), tx=optax.adam(1e-2))


def run(strategy, backend, n, extra=()):
    metrics_list = [jdp.metrics.fingerprint(), jdp.metrics.replicas_agree(), *extra]
    step = models.backend(
        backend, jdp.make_train_step(models.mlp_loss, strategy=strategy, metrics=metrics_list), n
    )
    state = step.replicate(initial_state())
    prints = []
    for batch in DATA:
        state, metrics = step(state, step.shard(batch))
        prints.append(np.asarray(metrics["fingerprint"]))
        assert np.all(np.asarray(metrics["replicas_agree"]) == 1)
    return step, state, prints


@functools.cache
def _one_device_fingerprint():
    """Built once: every call with a state of the same structure reuses one compilation."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("batch",))
    return jax.jit(
        jax.shard_map(
            lambda s: state_fingerprint(s, "batch")[0][None],
            mesh=mesh,
            in_specs=jax.sharding.PartitionSpec(),
            out_specs=jax.sharding.PartitionSpec("batch"),
            check_vma=False,
        )
    )


def host_fingerprint(logical_state):
    """The fingerprint of a logical (one-copy) state, computed on one device."""
    return np.asarray(_one_device_fingerprint()(logical_state))[0]


def test_exact_mode_prints_the_same_fingerprint_on_every_device_count(backend):
    reference = None
    for n in (1, 2, 4, 8):
        _, _, prints = run(jdp.strategies.exact(8), backend, n)
        # Every replica reports the same value, step by step.
        assert all(np.all(p == p[0]) for p in prints)
        firsts = [p[0].tolist() for p in prints]
        reference = reference or firsts
        assert firsts == reference, n
    assert len({tuple(f) for f in reference}) == len(DATA)  # it changes as the state does


@pytest.mark.parametrize("name", ["data_parallel", "zero1"])
def test_the_fingerprint_is_that_of_the_logical_state(name, backend):
    """zero1's slices, hashed where they live and summed, give the logical state's fingerprint."""
    strategy = getattr(jdp.strategies, name)()
    step, state, prints = run(strategy, backend, 8)
    logical = step.unreplicate(state)
    np.testing.assert_array_equal(prints[-1][0], host_fingerprint(logical))


def test_any_single_flipped_bit_changes_both_lanes():
    state = jax.device_get(initial_state())
    reference = host_fingerprint(state)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(0)
    for _ in range(100):
        i = int(rng.integers(len(leaves)))
        flat = np.asarray(leaves[i]).copy().reshape(-1)
        if flat.size == 0:
            continue
        j = int(rng.integers(flat.size))
        bits = flat.view(np.uint32) if flat.dtype.itemsize == 4 else None
        assert bits is not None, flat.dtype
        bits[j] ^= np.uint32(1) << np.uint32(rng.integers(32))
        changed = list(leaves)
        changed[i] = flat.reshape(np.shape(leaves[i]))
        flipped = host_fingerprint(jax.tree.unflatten(treedef, changed))
        assert np.all(flipped != reference), (i, j)


def test_replicas_agree_reports_a_replica_that_drifts():
    base = jdp.make_train_step(models.mlp_loss, metrics=[jdp.metrics.replicas_agree()])

    @jdp.wraps(base)
    def drifting(state, batch):
        state, _ = base(state, batch)
        drift = jax.lax.axis_index("batch").astype(jnp.float32) * 1e-3
        state = state.replace(params={**state.params, "b1": state.params["b1"] + drift})
        return state, {
            "replicas_agree": jdp.metrics.replicas_agree().compute(
                jdp.metrics.StepView(state, state, None, None, "batch")
            )
        }

    step = jdp.shard_map(drifting)
    _, metrics = step(step.replicate(initial_state()), step.shard(DATA[0]))
    assert np.asarray(metrics["replicas_agree"]).tolist() == [0] * 8


def test_fit_logs_the_fingerprint_as_integers():
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss, metrics=[jdp.metrics.fingerprint()]))
    _, history = jdp.fit(
        step,
        step.replicate(initial_state()),
        jdp.BatchIterator(DATA[0], 16, shuffle=False),
        num_steps=2,
        log_every=1,
        progress=False,
    )
    row = history.train[-1]
    assert len(row["fingerprint"]) == 2 and all(isinstance(v, int) for v in row["fingerprint"])


@pytest.mark.parametrize("name", ["data_parallel", "zero1", "fsdp"])
def test_a_checkpoint_records_the_fingerprints_the_step_reports(name, backend, tmp_path):
    prints = [jdp.metrics.fingerprint(), jdp.metrics.leaf_fingerprints()]
    strategy = getattr(jdp.strategies, name)()
    step = models.backend(
        backend, jdp.make_train_step(models.mlp_loss, strategy=strategy, metrics=prints), 8
    )
    state, metrics = step(step.replicate(initial_state()), step.shard(DATA[0]))
    with jdp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        recorded = ckpt.fingerprints()
    assert recorded["state"] == np.asarray(metrics["fingerprint"])[0].tolist()
    assert list(recorded["leaves"].values()) == np.asarray(metrics["leaf_fingerprints"])[0].tolist()
    assert list(recorded["leaves"]) == [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(initial_state())[0]
    ]
