"""Types that help: a user's state class survives create, replicate, a step and fit (mypy)."""

import pathlib
import subprocess
import sys
import textwrap

USER_SCRIPT = textwrap.dedent(
    """
    from typing import Any

    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp


    class MyState(jdp.TrainState):
        ema: Any = None


    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)


    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)
    state = MyState.create(params=jnp.zeros(3), tx=optax.adam(schedule), ema=jnp.zeros(3))
    reveal_type(state)
    train_step = jdp.shard_map(jdp.make_train_step(loss_fn, log_learning_rate=schedule))
    evaluator = jdp.pmap(jdp.make_eval_step(lambda p, b: {"e": b["y"]}))
    state = train_step.replicate(state)
    reveal_type(state)
    batch = {"x": np.ones((64, 3), np.float32), "y": np.ones(64, np.float32)}
    state, metrics = train_step(state, train_step.shard(batch))
    reveal_type(state)
    final, history = jdp.fit(train_step, state, [batch], num_steps=1, progress=False)
    reveal_type(final)
    reveal_type(evaluator)
    """
)


def test_the_state_type_is_the_users_own_class(tmp_path: pathlib.Path):
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--ignore-missing-imports", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    revealed = [
        line.split("Revealed type is ")[1] for line in out.stdout.splitlines() if "Revealed" in line
    ]
    assert revealed == ['"user.MyState"'] * 4 + [
        '"jdp.backends._pmap.PmapStep[jdp._steps.EvalStep]"'
    ], out.stdout
    assert "error" not in out.stdout.replace("Revealed", ""), out.stdout
