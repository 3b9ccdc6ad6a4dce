"""Exact mode on the model zoo: every family bitwise on 1, 2, 4, 8 devices and across processes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdp
from jdp.testing import check_exact
from tests import models, zoo


@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_family_is_bitwise_equal_on_1_2_4_8_devices(family, backend):
    make_step, state, batches = zoo.FAMILIES[family]()
    results = check_exact(make_step, state, batches, backend=getattr(jdp, backend))
    # It trained: every parameter and statistic moved (zeros would be exact trivially).
    final = results[1][0]
    moved = [(state.params, final.params), (state.model_state, final.model_state)]
    for before, after in moved:
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            if jnp.issubdtype(a.dtype, jnp.floating):
                assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_zoo_on_two_processes_of_two_devices_equals_one_of_four(tmp_path):
    out = {}
    for processes, devices in [(2, 2), (1, 4)]:  # each run trains under both backends
        path = tmp_path / f"{processes}x{devices}.npz"
        models.launch("multiprocess_zoo.py", processes, devices, path, timeout=400)
        out[processes] = np.load(path)
    names = {tuple(name.split("/")[:2]) for name in out[1].files}
    assert names == {(b, f) for b, families in zoo.ACROSS_PROCESSES.items() for f in families}
    assert set(zoo.ACROSS_PROCESSES["shard_map"]) == set(zoo.FAMILIES) - {"unet"}
    for name in out[1].files:
        np.testing.assert_array_equal(out[1][name], out[2][name], err_msg=name)


def test_an_outer_jit_is_warned_and_exact_with_the_strategys_options():
    make_step, state, batches = zoo.transformer()
    reference = check_exact(make_step, state, batches[:1], device_counts=(2,))[2][0]
    step = models.backend("pmap", make_step(), 1)
    with pytest.warns(UserWarning, match=r"compiler_options=\{'xla_disable_hlo_passes': 'cse'\}"):
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
