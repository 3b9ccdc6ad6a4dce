"""Exact mode on the model zoo: every family bitwise on 1, 2, 4, 8 devices under both backends.

Across processes: tests/test_zoo_processes.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.tree_util import keystr

import jdp
from jdp._tree import is_prng_key
from jdp.testing import check_exact
from tests import models, zoo


@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_family_is_bitwise_equal_on_1_2_4_8_devices_and_both_backends(family):
    make_step, state, batches = zoo.FAMILIES[family]()
    results = {
        name: check_exact(make_step, state, batches, backend=getattr(jdp, name))
        for name in ("shard_map", "pmap")
    }
    # It trained: every parameter and statistic moved (zeros would be exact trivially).
    final = results["shard_map"][1][0]
    moved = [(state.params, final.params), (state.model_state, final.model_state)]
    for before, after in moved:
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            if jnp.issubdtype(a.dtype, jnp.floating):
                assert not np.array_equal(np.asarray(a), np.asarray(b))
    # The two backends compile the same update: an exact checkpoint resumes under either.
    flat = jax.tree_util.tree_flatten_with_path(results["shard_map"][8])[0]
    for (path, a), b in zip(flat, jax.tree.leaves(results["pmap"][8]), strict=True):
        a, b = (np.asarray(jax.random.key_data(x) if is_prng_key(x) else x) for x in (a, b))
        np.testing.assert_array_equal(a, b, err_msg=f"pmap vs shard_map: {keystr(path)}")


def test_an_outer_jit_is_warned_and_exact_with_the_strategys_options():
    make_step, state, batches = zoo.transformer()
    reference = check_exact(make_step, state, batches[:1], device_counts=(2,))[2][0]
    step = models.backend("pmap", make_step(), 1)
    with pytest.warns(
        UserWarning,
        match=r"compiler_options=\{'xla_disable_hlo_passes': 'cse', 'xla_gpu_deterministic_ops': True\}",
    ):
        jax.jit(step).lower(step.replicate(state), step.shard(batches[0]))
    # With the options on the outer jit (the trace above is reused: no second warning).
    jitted = jax.jit(step, compiler_options=step.step.compiler_options)
    placed, _ = jitted(step.replicate(state), step.shard(batches[0]))
    for a, b in zip(
        jax.tree.leaves(reference.params),
        jax.tree.leaves(placed.params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[0])  # the one device's row
