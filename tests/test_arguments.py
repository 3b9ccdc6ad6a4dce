"""Bad arguments get an error naming the argument and the fix; stale views of a folder are refreshed.

One rule throughout: TypeError for the wrong kind, ValueError for the wrong value.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
import jdp.nnx
from jdp.testing import check_exact
from tests import models

DATA = models.regression_batch(64, seed=11)


def train_step():
    return jdp.shard_map(jdp.make_train_step(models.mlp_loss))


def initial_state():
    return jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))


def fit(**kwargs):
    step = train_step()
    return jdp.fit(
        step,
        step.replicate(initial_state()),
        jdp.BatchIterator(DATA, 16, seed=0),
        num_steps=kwargs.pop("num_steps", 2),
        progress=False,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"log_every": 0}, ValueError, r"fit: log_every must be an int >= 1, got 0"),
        ({"log_every": -1}, ValueError, r"fit: log_every must be an int >= 1, got -1"),
        ({"log_every": 2.5}, TypeError, r"fit: log_every must be an int >= 1, got 2.5 \(float\)"),
        ({"eval_every": -1}, ValueError, r"fit: eval_every must be an int >= 1, got -1"),
        ({"num_steps": True}, TypeError, r"fit: num_steps must be an int >= 0, got True"),
        ({"num_steps": -3}, ValueError, r"fit: num_steps must be an int >= 0, got -3"),
    ],
)
def test_fit_refuses_bad_counts(kwargs, error, match):
    with pytest.raises(error, match=match):
        fit(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"callbacks": print}, r"^jdp.fit: callbacks must be a list of functions of a logged row"),
        ({"callbacks": [3]}, r"^jdp.fit: callbacks\[0\] is a int, not a function"),
        ({"on_epoch_end": 3}, r"^jdp.fit: on_epoch_end must be a function \(epoch, state\)"),
        (
            {"checkpointer": "/tmp/run"},
            r"^jdp.fit: checkpointer must be a jdp.Checkpointer.*got str",
        ),
        ({"progress": "no"}, r"^jdp.fit: progress must be True or False, got 'no'"),
    ],
)
def test_fit_refuses_hooks_of_the_wrong_kind(kwargs, match):
    step = train_step()
    args = {"num_steps": 2, "progress": False, **kwargs}
    with pytest.raises(TypeError, match=match):
        jdp.fit(step, step.replicate(initial_state()), jdp.BatchIterator(DATA, 16, seed=0), **args)


def test_fit_refuses_missing_data_and_an_unplaced_state():
    step = train_step()
    with pytest.raises(TypeError, match=r"^jdp.fit: train_data must be an iterable .* NoneType"):
        jdp.fit(step, step.replicate(initial_state()), None, num_steps=1, progress=False)
    unplaced = r"^jdp.fit: the state is not placed on the step's devices .* pass state = train_step"
    with pytest.raises(ValueError, match=unplaced):
        jdp.fit(step, initial_state(), [DATA], num_steps=1, progress=False)


def test_a_checkpoint_refuses_a_function_in_the_state(tmp_path):
    with (
        jdp.Checkpointer(tmp_path) as ckpt,
        pytest.raises(TypeError, match=r"^jdp.Checkpointer.save: leaf \['f'\] is a function"),
    ):
        ckpt.save(1, {"w": np.ones(2), "f": lambda: 0})
    with jdp.Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == []


def test_fit_refuses_checkpoint_every_zero(tmp_path):
    with (
        jdp.Checkpointer(tmp_path) as ckpt,
        pytest.raises(ValueError, match="checkpoint_every must be an int >= 1, got 0"),
    ):
        fit(checkpointer=ckpt, checkpoint_every=0)


@pytest.mark.parametrize("reduce", ["Sum", "avg", None])
def test_reduce_gradients_refuses_an_unknown_reduction(reduce):
    f = jax.pmap(lambda g: jdp.reduce_gradients(g, "batch", reduce), axis_name="batch")
    with pytest.raises(ValueError, match=f"unknown grad_reduce={reduce!r}; expected one of"):
        f(jnp.arange(8.0))


def exact_step():
    return jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.exact(8))


def test_check_exact_refuses_what_it_cannot_check():
    state = initial_state()
    with pytest.raises(ValueError, match=r"device_counts=\(1, 16\) but 8 devices are here"):
        check_exact(exact_step, state, [DATA], device_counts=(1, 16))
    with pytest.raises(ValueError, match="batches is empty"):
        check_exact(exact_step, state, [])
    with pytest.raises(ValueError, match="not in exact mode .its strategy is data_parallel"):
        check_exact(lambda: jdp.make_train_step(models.mlp_loss), state, [DATA])
    with pytest.raises(TypeError, match="backend must be jdp.shard_map or jdp.pmap"):
        check_exact(exact_step, state, [DATA], backend="pmap")


def test_check_exact_names_a_replica_that_drifts_the_step_it_does():
    """A wrapper that makes replicas disagree is caught after its first step, replica named."""
    base = exact_step()

    @jdp.wraps(base)
    def drifting(state, batch):
        state, metrics = base(state, batch)
        drift = jax.lax.axis_index("batch").astype(jnp.int32)
        return state.replace(skipped_steps=state.skipped_steps + drift), metrics

    with pytest.raises(
        AssertionError,
        match=r"broke on 2 devices after step 1: .*\.skipped_steps: replica 1 differs",
    ):
        check_exact(lambda: drifting, initial_state(), [DATA, DATA], device_counts=(1, 2))


def test_a_second_checkpointer_on_the_folder_sees_new_saves(tmp_path):
    step = train_step()
    state = step.replicate(initial_state())
    with jdp.Checkpointer(tmp_path) as writer, jdp.Checkpointer(tmp_path) as reader:
        writer.save(1, state)
        assert reader.latest_step() == 1
        state, _ = step(state, step.shard(DATA))
        writer.save(2, state)
        assert reader.latest_step() == 2
        assert reader.all_steps() == [1, 2]
        restored, _ = reader.restore(step.replicate(initial_state()))
        np.testing.assert_array_equal(int(step.unreplicate(restored).step), 1)
        for a, b in zip(
            jax.tree.leaves(step.unreplicate(restored).params),
            jax.tree.leaves(step.unreplicate(state).params),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)


def test_a_checkpoint_of_another_format_is_refused(tmp_path):
    with jdp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, initial_state())
    metas = [p for p in pathlib.Path(tmp_path, "1").rglob("*") if p.is_file() and "meta" in str(p)]
    edited = 0
    for path in metas:
        try:
            meta = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(meta, dict) and "format" in meta:
            path.write_text(json.dumps({**meta, "format": 99}))
            edited += 1
    assert edited == 1
    with (
        jdp.Checkpointer(tmp_path) as ckpt,
        pytest.raises(ValueError, match="has format 99, but this jdp reads format 1"),
    ):
        ckpt.restore(initial_state())


def test_make_eval_step_refuses_a_strategy_of_the_wrong_kind():
    with pytest.raises(TypeError, match="make_eval_step: strategy must be a jdp.strategies value"):
        jdp.make_eval_step(lambda p, b: {}, strategy="zero1")


def test_a_removed_keyword_is_a_type_error_and_a_deprecated_one_names_its_removal():
    with pytest.raises(TypeError, match="unexpected keyword argument 'log_grad_norms'"):
        jdp.make_train_step(models.mlp_loss, log_grad_norms=True)
    with pytest.warns(DeprecationWarning, match=r"deprecated in 0.1.0 and removed in 0.2.0"):
        jdp.make_train_step(models.mlp_loss, grad_reduce="sum")


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("0", ValueError, "positive number of seconds, got '0'"),
        ("-5", ValueError, "positive number of seconds, got '-5'"),
        ("10m", ValueError, r"number of seconds, got '10m' \(e.g. 600"),
        ("inf", ValueError, "positive number of seconds"),
        (True, TypeError, "number of seconds, got True"),
        ([5], TypeError, "number of seconds"),
    ],
)
def test_a_timeout_must_be_a_positive_number_of_seconds(value, error, match):
    with pytest.raises(error, match=match):
        jdp.distributed.timeout_seconds(value, "$JDP_TIMEOUT")


def test_a_fractional_timeout_rounds_up_to_whole_seconds():
    assert jdp.distributed.timeout_seconds("30.5", "$JDP_TIMEOUT") == 31
    assert jdp.distributed.timeout_seconds(120, "timeout") == 120


@pytest.mark.parametrize(
    ("address", "match"),
    [
        (
            "http://10.0.0.1:1234",
            r"is a URL; give host:port without a scheme, e.g. '10.0.0.1:1234'",
        ),
        ("grpc://head:8476/", "is a URL"),
        ("10.0.0.1", "is not host:port"),
        ("head:port", "is not host:port"),
        (":1234", "is not host:port"),
        ("head:70000", "is not host:port"),
    ],
)
def test_a_coordinator_address_must_be_host_and_port(address, match):
    with pytest.raises(ValueError, match=match):
        jdp.distributed.check_address(address)
    jdp.distributed.check_address("[::1]:1234")  # IPv6 with a port is fine


INITIALIZE = (
    "import jdp, os, sys\n"
    "try:\n"
    "    jdp.distributed.initialize()\n"
    "except ValueError as e:\n"
    "    print('ValueError', e)\n"
    "    for name in sys.argv[1:]:  # fixed, the call can be made again\n"
    "        del os.environ[name]\n"
    "    jdp.distributed.initialize()\n"
    "    print('joined')\n"
)


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"JDP_TIMEOUT": "0"}, "$JDP_TIMEOUT must be a positive number of seconds"),
        ({"JDP_TIMEOUT": "10m"}, "$JDP_TIMEOUT must be a number of seconds"),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "http://127.0.0.1:1",
                "JAX_NUM_PROCESSES": "1",
                "JAX_PROCESS_ID": "0",
            },
            "is a URL",
        ),
    ],
)
def test_initialize_refuses_bad_variables_before_joining(variables, expected):
    """A fresh process: before, a URL hung in the join and 0 aborted with a heartbeat error."""
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if not k.startswith(("JDP_", "JAX_", "SLURM"))}
    environ |= variables
    run = subprocess.run(
        [sys.executable, "-c", INITIALIZE, *variables],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    first = run.stdout.splitlines()[0]
    assert first.startswith("ValueError jdp.distributed.initialize: ") and expected in first, first
    assert run.stdout.splitlines()[1] == "joined"


def test_the_launcher_keeps_an_exported_jdp_timeout(monkeypatch):
    from jdp import launch

    monkeypatch.setenv("JDP_TIMEOUT", "45")
    assert launch._timeout(None) == 45  # was overridden by the default 120
    assert launch._timeout(30.0) == 30  # --timeout wins
    monkeypatch.delenv("JDP_TIMEOUT")
    assert launch._timeout(None) == launch.DEFAULT_TIMEOUT
    monkeypatch.setenv("JDP_TIMEOUT", "-5")
    with pytest.raises(ValueError, match=r"^jdp.launch: \$JDP_TIMEOUT must be a positive"):
        launch._timeout(None)


def _loss(params, batch):
    return models.mlp_loss(params, batch)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (
            lambda: jdp.make_train_step(_loss, has_aux="yes"),
            TypeError,
            "has_aux must be True or False",
        ),
        (lambda: jdp.make_train_step(_loss, has_rng=1), TypeError, "has_rng must be True or False"),
        (
            lambda: jdp.make_train_step(_loss, axis_name=3),
            TypeError,
            "axis_name must be a non-empty",
        ),
        (
            lambda: jdp.make_eval_step(lambda p, b: {}, has_model_state="no"),
            TypeError,
            "^jdp.make_eval_step: has_model_state must be True or False",
        ),
        (lambda: jdp.Checkpointer(5), TypeError, r"^jdp.Checkpointer: directory must be a path"),
        (
            lambda: jdp.Checkpointer("/tmp/jdp-unused", async_save="no"),
            TypeError,
            "^jdp.Checkpointer: async_save must be True or False",
        ),
        (
            lambda: jdp.strategies.data_parallel(communication=jnp.int8),
            TypeError,
            "^jdp.strategies.data_parallel: communication must be a jdp.strategies Communication",
        ),
        (
            lambda: jdp.strategies.zero1(communication=jnp.bfloat16),
            TypeError,
            "^jdp.strategies.zero1: communication must be",
        ),
        (lambda: jdp.pmap(jdp.make_train_step(_loss), devices=[]), ValueError, "devices is empty"),
        (
            lambda: jdp.shard_map(jdp.make_train_step(_loss), devices=[]),
            ValueError,
            "devices is empty",
        ),
        (lambda: jdp.replicate({"w": jnp.ones(3)}, devices=[]), ValueError, "devices is empty"),
        (lambda: jdp.shard({"w": np.ones((8, 3))}, devices=[]), ValueError, "devices is empty"),
        (
            lambda: jdp.Policy(compute_dtype="float8"),
            TypeError,
            "^jdp.Policy: compute_dtype must be",
        ),
        (
            lambda: jdp.evaluate(jdp.shard_map(jdp.make_eval_step(lambda p, b: {})), None, None),
            TypeError,
            "^jdp.evaluate: batches must be an iterable",
        ),
        (
            lambda: jdp.distributed.initialize("127.0.0.1:1234", "2", 0),
            TypeError,
            r"^jdp.distributed.initialize: num_processes must be an int >= 1, got '2'",
        ),
        (
            lambda: jdp.distributed.initialize("127.0.0.1:1234", 2, -1),
            ValueError,
            "process_id must be an int >= 0",
        ),
        (
            lambda: jdp.pmap(jdp.make_train_step(_loss), devices=[jax.devices()[0]] * 2),
            ValueError,
            r"^jdp.pmap: devices holds cpu:0 twice \(at 0 and 1\); each replica needs a device",
        ),
        (
            lambda: jdp.shard_map(jdp.make_train_step(_loss), devices=[jax.devices()[1]] * 2),
            ValueError,
            r"^jdp.shard_map: devices holds cpu:1 twice",
        ),
        (
            lambda: jdp.shard({"w": np.ones((8, 3))}, devices=["cpu:0"]),
            TypeError,
            r"^jdp.replicate or jdp.shard: devices\[0\] is a str, not a jax.Device",
        ),
        (
            lambda: jdp.BatchIterator({"x": np.ones((16, 2))}, batch_size=8, seed="a"),
            TypeError,
            r"^jdp.BatchIterator: seed must be an int >= 0, got 'a'",
        ),
        (
            lambda: next(jdp.prefetch_to_device(3, 2)),
            TypeError,
            r"^jdp.prefetch_to_device takes an iterable of host batches .* got int",
        ),
        (
            lambda: jdp.replicate_across({"w": jnp.ones(3)}, "batch"),
            TypeError,
            r"^jdp.replicate_across: mesh must be a jax.sharding.Mesh",
        ),
        (
            lambda: jdp.broadcast({"w": jnp.ones(3)}),
            NameError,
            r"^jdp.broadcast runs inside a step, over the data axis its backend binds \('batch'",
        ),
        (
            lambda: jdp.reduce_gradients({"w": jnp.ones(3)}, "batch"),
            NameError,
            r"^jdp.reduce_gradients runs inside a step",
        ),
        (
            lambda: jdp.assert_replicas_in_sync(jdp.replicate({"w": jnp.ones(3)}), atol=-1.0),
            ValueError,
            r"^jdp.assert_replicas_in_sync: atol must be a finite number >= 0",
        ),
        (
            lambda: jdp.assert_replicas_in_sync(jdp.replicate({"w": jnp.ones(3)}), atol="0"),
            TypeError,
            r"^jdp.assert_replicas_in_sync: atol must be a number >= 0 .* got '0' \(str\)",
        ),
        (
            lambda: jdp.TensorBoardLogger(3),
            TypeError,
            r"^jdp.TensorBoardLogger: logdir must be a path",
        ),
        (
            lambda: jdp.TensorBoardLogger("/tmp/jdp-unused-tb")([0.5]),
            TypeError,
            r"^jdp.TensorBoardLogger: a row is a dict with a 'step' entry.*got a list",
        ),
        (
            lambda: jdp.strategies.cast_communication("fp16"),
            TypeError,
            r"^jdp.strategies.cast_communication: dtype must be floating .* got 'fp16'",
        ),
        (
            lambda: jdp.apply_gradients(
                jdp.TrainState.create(params={"w": jnp.ones(3)}, tx=optax.sgd(0.1)),
                {"v": jnp.ones(3)},
            ),
            ValueError,
            r"^jdp.apply_gradients: grads must have the structure of state.params .* got "
            r"PyTreeDef\(\{'v': \*\}\), expected PyTreeDef\(\{'w': \*\}\)",
        ),
        (
            lambda: jdp.make_train_step(_loss, metrics=[jdp.metrics.Metric("x", 3)]),  # type: ignore[arg-type]
            TypeError,
            r"^jdp.metrics.Metric 'x': compute must be a function \(view: jdp.metrics.StepView\)",
        ),
        (
            lambda: jdp.make_train_step(
                _loss,
                metrics=[jdp.metrics.Metric("x", lambda view: 0.0, "mean")],  # type: ignore[arg-type]
            ),
            TypeError,
            r"^jdp.metrics.Metric 'x': rule must be a function \(values, weights\) -> value",
        ),
        (
            lambda: jdp.BatchIterator({"x": np.ones((16, 2))}, batch_size=8, repeat="no"),
            TypeError,
            r"^jdp.BatchIterator: repeat must be True or False, got 'no'",
        ),
        (
            lambda: jdp.BatchIterator({"x": np.ones((16, 2))}, batch_size=8, shuffle="yes"),
            TypeError,
            r"^jdp.BatchIterator: shuffle must be True or False, got 'yes'",
        ),
        (
            lambda: jdp.BatchIterator({"x": np.ones((16, 2))}, 8, remainder="pad", mask_key=3),
            TypeError,
            r"^jdp.BatchIterator: mask_key must be a non-empty string, got 3",
        ),
        (
            lambda: jdp.StaticLossScale("1024"),  # type: ignore[arg-type]
            TypeError,
            r"^jdp.StaticLossScale.loss_scale must be a number, got '1024'",
        ),
        (
            lambda: jdp.History.from_dict("history.json"),  # type: ignore[arg-type]
            TypeError,
            r"^jdp.History.from_dict takes the dict dataclasses.asdict\(history\) gives",
        ),
        (
            lambda: jdp.WeightedLoss("a", 1.0),  # type: ignore[arg-type]
            TypeError,
            r"^jdp.WeightedLoss.total must be a number or numeric array .* got 'a'",
        ),
        (
            lambda: check_exact(3, initial_state(), [DATA]),  # type: ignore[arg-type]
            TypeError,
            r"^jdp.check_exact: make_step must be a function that builds the step.* got int",
        ),
        (
            lambda: jdp.nnx.merge(None, {}, ({}, {})),  # type: ignore[arg-type]
            TypeError,
            r"^jdp.nnx.merge: graphdef must be the nnx.GraphDef jdp.nnx.split returned, got NoneType",
        ),
        (
            lambda: jdp.nnx.state({"w": 1}, ({}, {})),  # type: ignore[arg-type]
            TypeError,
            r"^jdp.nnx.state expects the nnx.Module the loss merged \(jdp.nnx.merge\), got dict",
        ),
    ],
)
def test_arguments_of_the_wrong_kind_or_value_are_refused_by_name(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_shard_map_takes_its_devices_as_any_iterable():
    step = jdp.shard_map(jdp.make_train_step(_loss), devices=iter(jax.devices()[:2]))
    assert step.mesh.devices.tolist() == jax.devices()[:2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--processes", "0", "train.py"], "--processes and --devices-per-process must be >= 1"),
        (["--processes", "2", "--max-restarts", "-1", "train.py"], "--max-restarts must be >= 0"),
        (["--processes", "2", "--timeout", "0", "train.py"], "--timeout must be a positive number"),
        (["--processes", "2", "missing.py"], "script 'missing.py' is not a file: pass the path"),
    ],
)
def test_the_launcher_refuses_bad_arguments_before_starting_anything(argv, message, capsys):
    from jdp import launch

    with pytest.raises(SystemExit) as exit_:
        launch.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
