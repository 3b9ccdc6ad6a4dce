"""Strategies: one seam for how gradients cross replicas; steps as typed values."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import import_graph, models

N = 4
DATA = [models.regression_batch(32, seed=700 + i) for i in range(4)]


def train(strategy_or_kwargs, backend="pmap", steps=DATA, tx=None):
    kwargs = strategy_or_kwargs if isinstance(strategy_or_kwargs, dict) else {}
    if not isinstance(strategy_or_kwargs, dict):
        kwargs = {"strategy": strategy_or_kwargs}
    step = models.backend(backend, jdp.make_train_step(models.mlp_loss, **kwargs), N)
    state = step.replicate(
        jdp.TrainState.create(params=models.mlp_params(), tx=tx or optax.adam(1e-2))
    )
    for batch in steps:
        state, _ = step(state, step.shard(batch))
    return jax.device_get(step.unreplicate(state))


def assert_bitwise(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    ("legacy", "strategy"),
    [
        ({"grad_reduce": "sum"}, lambda: jdp.strategies.data_parallel(reduce="sum")),
        ({"accumulate_steps": 2}, lambda: jdp.strategies.data_parallel(accumulate_steps=2)),
        ({"virtual_replicas": 8}, lambda: jdp.strategies.exact(8)),
        ({"shard_optimizer": True}, lambda: jdp.strategies.zero1()),
    ],
    ids=["grad_reduce", "accumulate_steps", "virtual_replicas", "shard_optimizer"],
)
def test_old_keyword_arguments_still_work_with_a_deprecation_warning(legacy, strategy):
    ((name, value),) = legacy.items()
    with pytest.warns(DeprecationWarning, match=rf"{name}={value!r}.*strategy=jdp.strategies"):
        old = train(legacy)
    assert_bitwise(old, train(strategy()))


def test_strategy_and_old_arguments_do_not_mix():
    with pytest.raises(ValueError, match="accumulate_steps=2 and strategy= both choose"):
        jdp.make_train_step(
            models.mlp_loss, accumulate_steps=2, strategy=jdp.strategies.data_parallel()
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="virtual_replicas .exact mode. does not combine"):
            jdp.make_train_step(models.mlp_loss, virtual_replicas=8, shard_optimizer=True)
        with pytest.raises(TypeError, match="shard_optimizer must be a bool, got 'yes'"):
            jdp.make_train_step(models.mlp_loss, shard_optimizer="yes")
    with pytest.raises(TypeError, match="strategy must be a jdp.strategies.Strategy"):
        jdp.make_train_step(models.mlp_loss, strategy="zero1")


def test_exact_has_no_options_that_break_it():
    with pytest.raises(TypeError, match="accumulate_steps"):
        jdp.strategies.exact(8, accumulate_steps=2)
    with pytest.raises(TypeError, match="communication"):
        jdp.strategies.exact(8, communication=jdp.strategies.cast_communication())


@pytest.mark.parametrize("name", ["data_parallel", "zero1", "exact"])
def test_a_wrapper_keeps_the_step_settings_with_jdp_wraps(backend, name):
    strategy = {"exact": lambda: jdp.strategies.exact(8)}.get(name, getattr(jdp.strategies, name))()
    base = jdp.make_train_step(models.mlp_loss, strategy=strategy)

    @jdp.wraps(base)
    def with_ema(state, batch):
        state, metrics = base(state, batch)
        ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, state.ema, state.params)
        return state.replace(ema=ema), metrics

    step = models.backend(backend, with_ema, N)
    assert isinstance(step.step, jdp.TrainStep) and step.step.strategy.name == name
    state = step.replicate(
        EMAState.create(params=models.mlp_params(), tx=optax.adam(1e-2), ema=models.mlp_params())
    )
    expected_ema = models.mlp_params()
    for batch in DATA:
        state, _ = step(state, step.shard(batch))
        params = step.unreplicate(state).params
        expected_ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, expected_ema, params)
    final = step.unreplicate(state)
    # The wrapper changes no update (to 1 ulp: XLA fuses the program with the EMA in it differently).
    reference = train(strategy, backend).params
    for x, y in zip(jax.tree.leaves(final.params), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    for x, y in zip(jax.tree.leaves(final.ema), jax.tree.leaves(expected_ema), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6)


class EMAState(jdp.TrainState):
    ema: object = None


def test_a_plain_wrapper_of_a_zero1_step_is_told_what_happened():
    base = jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.zero1())
    step = models.backend("pmap", lambda s, b: base(s, b), N)
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2)))
    with pytest.raises(TypeError, match=r"plain function around the zero1 step.*@jdp.wraps"):
        step(state, step.shard(DATA[0]))


def test_wraps_refuses_what_is_not_a_step():
    with pytest.raises(TypeError, match="jdp.wraps takes a step built by jdp.make_train_step"):
        jdp.wraps(lambda s, b: (s, {}))
    with pytest.raises(TypeError, match="already wrapped by a backend"):
        jdp.pmap(jdp.pmap(jdp.make_train_step(models.mlp_loss)))


def collective_bytes(stablehlo: str) -> int:
    """Bytes of every all-reduce and reduce-scatter result in a lowered step.

    Read from the program jdp hands XLA: XLA:CPU widens bfloat16 collectives
    back to float32 in its own compiled program (measured, JAX 0.10.2), while
    GPU and TPU collectives run in bfloat16.
    """
    sizes = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "ui32": 4, "i1": 1, "f64": 8}
    total, pending = 0, False
    for line in stablehlo.splitlines():
        if '"stablehlo.all_reduce"' in line or '"stablehlo.reduce_scatter"' in line:
            pending = True
        elif pending and line.strip().startswith("})") and "->" in line:
            pending = False
            for dims, dtype in re.findall(r"tensor<((?:\d+x)*)(\w+)>", line.split("->")[1]):
                count = int(np.prod([int(d) for d in dims.split("x") if d])) if dims else 1
                total += sizes[dtype] * count
    return total


@pytest.mark.parametrize("base", ["data_parallel", "zero1"])
def test_bfloat16_communication_halves_the_bytes_and_keeps_the_update(backend, base):
    make = getattr(jdp.strategies, base)
    plain = make()
    cast = make(communication=jdp.strategies.cast_communication(jnp.bfloat16))
    moved = {}
    for label, strategy in [("f32", plain), ("bf16", cast)]:
        step = models.backend(backend, jdp.make_train_step(models.mlp_loss, strategy=strategy), N)
        state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1)))
        hlo = step.lower(state, step.shard(DATA[0])).as_text()
        moved[label] = collective_bytes(hlo)
    # Every gradient collective moves bfloat16: exactly half the bytes.
    assert moved["f32"] >= 160 and 2 * moved["bf16"] == moved["f32"], moved
    exact_update = train(plain, backend, tx=optax.sgd(0.1), steps=DATA[:1]).params
    rounded = train(cast, backend, tx=optax.sgd(0.1), steps=DATA[:1]).params
    start = models.mlp_params()
    for p0, a, b in zip(*map(jax.tree.leaves, (start, exact_update, rounded)), strict=True):
        step_size = np.max(np.abs(np.asarray(a) - np.asarray(p0)))
        # bfloat16 keeps 8 significant bits: each summed gradient is within 2**-8 of itself
        # (N additions in bfloat16 at most N roundings).
        np.testing.assert_allclose(b, a, atol=N * 2.0**-8 * step_size, rtol=0)
        assert not np.array_equal(a, b) or step_size == 0  # it did round


def test_cast_communication_refuses_a_non_floating_dtype():
    with pytest.raises(TypeError, match="dtype must be floating"):
        jdp.strategies.cast_communication(jnp.int8)


def test_the_import_graph_is_layered_and_the_check_can_fail():
    root = import_graph.pathlib.Path(__file__).resolve().parent.parent
    assert import_graph.problems(import_graph.graph(root), import_graph.LAYERS) == []
    bad = {"jdp._tree": {"jdp._step"}, "jdp._step": {"jdp._tree"}}
    found = import_graph.problems(bad, import_graph.LAYERS)
    assert any("upward import" in f for f in found)
    assert any("import cycle: jdp._step -> jdp._tree -> jdp._step" in f for f in found), found
    assert import_graph.problems({"jdp._new": set()}, import_graph.LAYERS) == [
        "jdp._new has no layer in tests/import_graph.py"
    ]
