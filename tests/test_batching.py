"""shard / unshard / pad_batch: layout and errors."""

import jax
import numpy as np
import pytest

import jdp


def test_shard_makes_contiguous_blocks_one_per_device():
    batch = {"x": np.arange(32 * 3).reshape(32, 3), "y": np.arange(32)}
    sharded = jdp.shard(batch)
    assert sharded["x"].shape == (8, 4, 3)
    for i, shard in enumerate(
        sorted(sharded["y"].addressable_shards, key=lambda s: s.index[0].start)
    ):
        assert shard.device == jax.local_devices()[i]
        np.testing.assert_array_equal(shard.data[0], np.arange(4 * i, 4 * i + 4))


def test_unshard_inverts_shard():
    batch = {"x": np.random.RandomState(0).randn(16, 2).astype(np.float32)}
    np.testing.assert_array_equal(jdp.unshard(jdp.shard(batch))["x"], batch["x"])


def test_shard_on_a_subset_of_devices():
    sharded = jdp.shard(np.zeros((6, 2)), devices=jax.local_devices()[:2])
    assert sharded.shape == (2, 3, 2)


def test_indivisible_batch_names_leaf_sizes_and_padding():
    with pytest.raises(ValueError) as e:
        jdp.shard({"images": np.zeros((10, 2))})
    msg = str(e.value)
    assert "['images']" in msg and "B=10" in msg and "n=8" in msg and "pad_batch" in msg


def test_disagreeing_leaves_are_named():
    with pytest.raises(ValueError, match=r"\['x'\] has 16 .* \['y'\] has 8"):
        jdp.shard({"x": np.zeros((16, 2)), "y": np.zeros(8)})


def test_non_array_leaf_is_a_type_error():
    with pytest.raises(TypeError, match=r"pytree of arrays, but leaf \['name'\] is a str"):
        jdp.shard({"x": np.zeros(8), "name": "digits"})


def test_scalar_leaf_is_rejected():
    with pytest.raises(ValueError, match=r"\['t'\] is a scalar"):
        jdp.shard({"x": np.zeros(8), "t": np.float32(1.0)})


def test_unshard_needs_two_axes():
    with pytest.raises(ValueError, match=r"shape \(n, b, \.\.\.\), but \['x'\] has shape \(8,\)"):
        jdp.unshard({"x": np.zeros(8)})


def test_pad_batch_pads_with_zeros_and_masks():
    padded, mask = jdp.pad_batch({"x": np.ones((5, 2), np.float32), "y": np.arange(5)}, 8)
    assert padded["x"].shape == (8, 2) and padded["y"].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert mask.tolist() == [True] * 5 + [False] * 3
    assert padded["x"][5:].sum() == 0


def test_pad_batch_rejects_bad_multiple():
    with pytest.raises(ValueError, match="multiple must be an int >= 1, got 0"):
        jdp.pad_batch({"x": np.ones(3)}, 0)
