"""replicate / unreplicate / broadcast / sync_replicas / assert_replicas_in_sync."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdp


def tree():
    return {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(3), "key": jax.random.key(1)}


def test_replicate_puts_one_copy_per_device():
    rep = jdp.replicate(tree())
    assert rep["w"].shape == (8, 2, 3)
    for shard in rep["w"].addressable_shards:
        np.testing.assert_array_equal(shard.data[0], tree()["w"])
    assert {s.device for s in rep["w"].addressable_shards} == set(jax.local_devices())


def test_replicate_never_aliases_the_callers_arrays():
    original = tree()
    rep = jdp.replicate(original)
    jax.pmap(lambda t: t, donate_argnums=0)(rep)
    assert not original["w"].is_deleted()


def test_unreplicate_reads_replica_zero_locally():
    out = jdp.unreplicate(jdp.replicate(tree()))
    np.testing.assert_array_equal(out["w"], tree()["w"])
    assert out["w"].devices() == {jax.local_devices()[0]}
    assert int(out["step"]) == 3
    assert jax.random.key_data(out["key"]).tolist() == jax.random.key_data(tree()["key"]).tolist()


def test_replicate_across_mesh_has_no_device_axis_and_unreplicates():
    mesh = jax.make_mesh((8,), ("batch",))
    rep = jdp.replicate_across(tree(), mesh)
    assert rep["w"].shape == (2, 3) and rep["w"].sharding.is_fully_replicated
    jdp.assert_replicas_in_sync(rep)
    np.testing.assert_array_equal(jdp.unreplicate(rep)["w"], tree()["w"])


def test_unreplicate_of_an_unreplicated_tree_is_an_error():
    with pytest.raises(ValueError, match=r"leaf \['s'\] \(shape \(\)\) is a host float32"):
        jdp.unreplicate({"s": np.float32(1.0)})
    # Never replicated, on one device: row 0 would silently be the first row.
    with pytest.raises(ValueError, match=r"leaf \['w'\] \(shape \(8, 3\)\) lives on a single"):
        jdp.unreplicate({"w": jnp.ones((8, 3))})
    with pytest.raises(ValueError, match=r"assert_replicas_in_sync expects a replicated tree"):
        jdp.assert_replicas_in_sync({"w": jnp.ones((8, 3))})


def _desynced():
    rep = jdp.replicate({"a": jnp.zeros(2), "b": jnp.zeros((2, 2))})
    bump = jax.pmap(lambda x: x + (jax.lax.axis_index("i") == 5) * 0.25, axis_name="i")
    return {"a": rep["a"], "b": bump(rep["b"])}


def test_assert_in_sync_names_leaf_replica_and_difference():
    with pytest.raises(AssertionError, match=r"leaf \['b'\]: replica 5 differs .* by up to 0.25"):
        jdp.assert_replicas_in_sync(_desynced())
    jdp.assert_replicas_in_sync(_desynced(), atol=0.3)


def test_sync_replicas_rebroadcasts_replica_zero():
    synced = jdp.sync_replicas(_desynced())
    jdp.assert_replicas_in_sync(synced)
    np.testing.assert_array_equal(jdp.unreplicate(synced)["b"], np.zeros((2, 2)))


def test_sync_replicas_on_the_mesh_layout():
    mesh = jax.make_mesh((8,), ("batch",))
    synced = jdp.sync_replicas(jdp.replicate_across(tree(), mesh))
    assert synced["w"].shape == (2, 3)
    jdp.assert_replicas_in_sync(synced)


@pytest.mark.parametrize("source", [0, 3, 7])
def test_broadcast_inside_a_step_copies_the_source_replica(source):
    x = {"f": jnp.arange(8.0) * 1.5, "i": jnp.arange(8), "b": jnp.arange(8) % 2 == 0}
    out = jax.pmap(lambda t: jdp.broadcast(t, "batch", source), axis_name="batch")(x)
    for name in x:
        np.testing.assert_array_equal(out[name], np.full(8, np.asarray(x[name])[source]))


def test_broadcast_rejects_negative_source():
    with pytest.raises(ValueError, match=r"source \(a replica index\) must be an int >= 0, got -1"):
        jdp.broadcast(jnp.zeros(2), "batch", -1)
