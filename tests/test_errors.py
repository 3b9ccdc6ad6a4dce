"""Every user error gets a clear message that says what and how to fix it."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import optax
import pytest

import jdp
from tests import models


def state():
    return jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))


def batch(size=16):
    return models.regression_batch(size)


def run(loss_fn, data=None, **kwargs):
    step = jdp.pmap(jdp.make_train_step(loss_fn, **kwargs))
    return step(step.replicate(state()), step.shard(data or batch()))


def test_non_scalar_loss():
    with pytest.raises(ValueError, match=r"scalar loss, got shape \(2, 3\).*jnp.mean"):
        run(lambda p, b: (b["x"] @ p["w1"] @ p["w2"]) - b["y"])


def test_integer_loss():
    with pytest.raises(TypeError, match="floating loss, got dtype int32"):
        run(lambda p, b: jnp.sum(b["y"] > 0))


def test_batch_that_is_not_a_pytree_of_arrays():
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    with pytest.raises(TypeError, match=r"leaf \['tag'\] is a str"):
        step(step.replicate(state()), {**step.shard(batch()), "tag": "train"})


def test_unsharded_batch():
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    with pytest.raises(
        ValueError, match=r"\['x'\] has shape \(16, 6\).*leading device axis of 8.*shard"
    ):
        step(step.replicate(state()), batch())


def test_state_not_replicated():
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    with pytest.raises(
        ValueError, match=r"not replicated: state.step has shape \(\), expected \(8,\)"
    ):
        step(state(), step.shard(batch()))


def test_state_replicated_for_another_device_count():
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    four = jdp.replicate(state(), devices=jax.local_devices()[:4])
    with pytest.raises(ValueError, match="replicated for 4 devices but this step runs on 8"):
        step(four, step.shard(batch()))


def test_state_of_the_wrong_type():
    step = jdp.make_train_step(models.mlp_loss)
    with pytest.raises(TypeError, match="state must be a jdp.TrainState, got dict"):
        jax.pmap(step, axis_name="batch")(jdp.replicate({"p": 1.0}), jdp.shard(batch()))


def test_accumulate_steps_must_divide_the_replica_batch():
    with pytest.raises(
        ValueError, match="accumulate_steps=3 does not divide the per-replica batch of 2"
    ):
        run(models.mlp_loss, strategy=jdp.strategies.data_parallel(accumulate_steps=3))


@pytest.mark.parametrize("bad", [0, -2])
def test_accumulate_steps_must_be_positive(bad):
    with pytest.raises(ValueError, match=f"accumulate_steps must be an int >= 1, got {bad}"):
        jdp.strategies.data_parallel(accumulate_steps=bad)


def test_unknown_grad_reduce():
    with pytest.raises(
        ValueError, match=r"unknown reduce='avg'; expected one of \('mean', 'sum'\)"
    ):
        jdp.strategies.data_parallel(reduce="avg")


def test_precision_must_be_floating():
    with pytest.raises(TypeError, match="precision must be a jdp.Policy or a floating dtype"):
        jdp.make_train_step(models.mlp_loss, precision=jnp.int8)


def test_rng_requested_without_a_key():
    with pytest.raises(ValueError, match=r"has_rng=True\) needs a key.*rng=jax.random.key\(0\)"):
        run(lambda p, b, rng: models.mlp_loss(p, b), has_rng=True)


def test_wrong_return_structure():
    with pytest.raises(TypeError, match=r"must return \(loss, aux\) \(has_aux=True"):
        run(models.mlp_loss, has_aux=True)


def test_aux_must_be_a_dict():
    with pytest.raises(TypeError, match="aux must be a dict of arrays.*got tuple"):
        run(lambda p, b: (models.mlp_loss(p, b), (1.0,)), has_aux=True)


def test_aux_may_not_shadow_jdp_metrics():
    with pytest.raises(ValueError, match=r"aux keys \['loss'\] are reserved"):
        run(lambda p, b: (models.mlp_loss(p, b), {"loss": 1.0}), has_aux=True)


def test_axis_name_mismatch():
    with pytest.raises(
        ValueError, match="built with axis_name='data' but jdp.pmap binds axis_name='batch'"
    ):
        jdp.pmap(jdp.make_train_step(models.mlp_loss, axis_name="data"))


def test_shard_map_mesh_needs_the_data_axis():
    mesh = jax.make_mesh((8,), ("x",))
    with pytest.raises(
        ValueError,
        match=r"^jdp.shard_map: the mesh has no data axis 'batch' \(its axes are \('x',\)\)",
    ):
        jdp.shard_map(jdp.make_train_step(models.mlp_loss), mesh=mesh)


def test_shard_map_indivisible_batch():
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss))
    with pytest.raises(ValueError, match=r"B=12 examples over n=8 devices.*pad_batch"):
        step.shard(batch(12))


def test_train_state_rejects_non_optax_tx():
    with pytest.raises(TypeError, match="tx must be an optax.GradientTransformation"):
        jdp.TrainState.create(params={}, tx=0.1)


def test_train_state_rejects_a_seed_as_rng():
    with pytest.raises(
        TypeError, match=r"rng must be a PRNG key such as jax.random.key\(0\), got 0"
    ):
        jdp.TrainState.create(params={}, tx=optax.sgd(0.1), rng=0)


# The placeholders a message may open with: each names the public function,
# class or step its caller passes (``"jdp.fit"``, ``"jdp.shard_map step"``).
CALLER_NAMED = {"what", "where", "who", "name"}


def _opening(message):
    """A raised message's first characters, or its first placeholder's name."""
    if isinstance(message, ast.Constant) and isinstance(message.value, str):
        return message.value
    if isinstance(message, ast.JoinedStr):
        first = message.values[0]
        if isinstance(first, ast.Constant):
            return first.value
        return "{" + ast.unparse(first.value) + "}"
    return None  # a message built elsewhere (a variable, a call): checked where it is built


def test_every_error_jdp_raises_opens_with_jdp():
    """One prefix: ``jdp.<the function, class or step at fault>: `` (or ``jdp: ``).

    Scans every ``raise ...Error(message)`` in jdp/ (the demo's command-line
    errors aside: argparse names the flag); a message that opens with a
    placeholder gets it from its caller, and every caller's literal is checked
    by the same scan of the call sites below.
    """
    root = pathlib.Path(jdp.__file__).parent
    wrong = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "demo.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            if not node.exc.args or not getattr(node.exc.func, "id", "").endswith("Error"):
                continue
            opening = _opening(node.exc.args[0])
            if opening is None or opening.startswith(("jdp.", "jdp:")):
                continue
            placeholder = opening[1:].split("}")[0] if opening.startswith("{") else None
            if placeholder in CALLER_NAMED:
                continue
            wrong.append(f"{path.relative_to(root)}:{node.lineno}: {opening[:60]!r}")
    assert not wrong, "messages that do not open with jdp:\n" + "\n".join(wrong)


# Where each helper that opens a message with its caller's name takes it.
NAME_ARGUMENT = {
    **dict.fromkeys(("check_int", "check_bool", "check_name"), "where"),
    **dict.fromkeys(("check_call", "divisible_batch_size", "shard_blocks"), 2),
    **dict.fromkeys(("check_state", "check_reduce"), 3),
    **dict.fromkeys(("check_per_replica_rows", "check_model_state", "timeout_seconds"), 2),
    **dict.fromkeys(("require",), 2),
    **dict.fromkeys(("_check_scale",), 0),
    **dict.fromkeys(
        (
            "refuse_consumed",
            "refuse_placed",
            "_check_replicated",
            "_check_single_copy",
            "check_replicas_agree",
            "leaves_with_paths",
            "batch_size",
        ),
        1,
    ),
}


def test_every_caller_named_prefix_opens_with_jdp():
    """The names callers pass for those placeholders are jdp's public names."""
    root = pathlib.Path(jdp.__file__).parent
    wrong, seen = [], 0
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            callee = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            where = NAME_ARGUMENT.get(callee)
            if isinstance(where, str):
                given = next((k.value for k in node.keywords if k.arg == where), None)
            else:
                given = node.args[where] if where is not None and len(node.args) > where else None
            opening = None if given is None else _opening(given)
            if opening is None or opening.startswith("{"):
                continue  # passed on from its own caller, whose literal this scan checks
            seen += 1
            if not opening.startswith("jdp."):
                wrong.append(f"{path.relative_to(root)}:{node.lineno}: {callee}({opening!r})")
    assert seen > 40 and not wrong, (seen, wrong)


@pytest.mark.parametrize(
    ("call", "opening"),
    [
        (lambda: jdp.fit(None, None, [], num_steps=-1), "jdp.fit: "),
        (lambda: jdp.shard({"x": jnp.zeros((3, 2))}), "jdp.shard: cannot shard batch leaf"),
        (lambda: jdp.make_train_step("loss"), "jdp.make_train_step: loss_fn must be callable"),
        (lambda: jdp.unreplicate({"x": jnp.zeros(3)}), "jdp.unreplicate expects"),
        (lambda: jdp.Checkpointer(3), "jdp.Checkpointer: directory must be a path"),
    ],
)
def test_messages_open_with_the_public_name_at_run_time(call, opening):
    with pytest.raises((TypeError, ValueError)) as caught:
        call()
    assert str(caught.value).startswith(opening), str(caught.value)
