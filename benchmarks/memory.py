"""Per-device memory of the replicated step and of strategies.zero1(), against ZeRO's formula.

A float32 MLP of about 12.6M parameters (2048-2048-2048-2048, tanh) with Adam,
global batch 64, under jdp.shard_map on n = 1, 2, 4, 8 CPU devices. For each
layout it reports, per device:

  params / opt state   bytes of the placed state (device 0's shards)
  formula              ZeRO's model-state bytes (Rajbhandari et al. 2020, with
                       float32 everywhere: K = 8 bytes of Adam state per
                       parameter): replicated 4P + 4P + 8P, stage 1 (P_os)
                       4P + 4P + 8P/n, for P parameters (params + grads + state)
  peak                 XLA's compiled estimate: arguments + outputs +
                       temporaries - donated aliases (the step's real footprint,
                       activations and collectives' buffers included)

Compile only: nothing is trained. Usage: python benchmarks/memory.py [--json out.json]
"""

import argparse
import itertools
import json

import jax

import jdp

MiB = 2**20
SIZES = (2048, 2048, 2048, 2048)


def model():
    import jax.numpy as jnp
    import numpy as np

    r = np.random.RandomState(0)
    params = {
        f"w{i}": jnp.asarray(r.randn(a, b).astype(np.float32) * 0.01)
        for i, (a, b) in enumerate(itertools.pairwise(SIZES))
    }

    def loss(p, batch):
        h = batch["x"]
        for i in range(len(SIZES) - 1):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean(h**2)

    return params, loss, {"x": np.ones((64, SIZES[0]), np.float32)}


def device0_bytes(tree) -> int:
    return sum(
        x.addressable_shards[0].data.nbytes
        for x in jax.tree.leaves(tree)
        if isinstance(x, jax.Array)
    )


def measure(n: int, shard: bool, params, loss, batch) -> dict:
    import numpy as np
    import optax

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("batch",))
    step = jdp.shard_map(
        jdp.make_train_step(loss, strategy=jdp.strategies.zero1() if shard else None), mesh=mesh
    )
    state = step.replicate(jdp.TrainState.create(params=params, tx=optax.adam(1e-3)))
    m = step.lower(state, step.shard(batch)).compile().memory_analysis()
    count = sum(x.size for x in jax.tree.leaves(params))
    return {
        "n": n,
        "sharded": shard,
        "parameters": count,
        "params_mib": device0_bytes(state.params) / MiB,
        "opt_state_mib": device0_bytes(state.opt_state) / MiB,
        "formula_mib": (4 * count + 4 * count + 8 * count / (n if shard else 1)) / MiB,
        "peak_mib": (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )
        / MiB,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    jdp.force_cpu_devices(8)
    params, loss, batch = model()
    rows = [measure(n, s, params, loss, batch) for n in (1, 2, 4, 8) for s in (False, True)]
    print(
        f"\nper-device memory, MLP {SIZES} ({rows[0]['parameters'] / 1e6:.1f}M float32 "
        f"parameters), Adam, shard_map; jax {jax.__version__}"
    )
    print(
        f"{'n':>2} {'layout':>10} {'params MiB':>10} {'opt MiB':>8} {'opt x n/whole':>13}"
        f" {'formula MiB':>11} {'peak MiB':>9} {'peak/replicated':>15}"
    )
    for replicated, sharded in zip(rows[::2], rows[1::2], strict=True):
        for r in (replicated, sharded):
            ratio = r["opt_state_mib"] * r["n"] / replicated["opt_state_mib"]
            print(
                f"{r['n']:>2} {'sharded' if r['sharded'] else 'replicated':>10}"
                f" {r['params_mib']:>10.1f} {r['opt_state_mib']:>8.1f}"
                f" {ratio if r['sharded'] else 1.0:>13.4f} {r['formula_mib']:>11.1f}"
                f" {r['peak_mib']:>9.1f} {r['peak_mib'] / replicated['peak_mib']:>15.3f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
