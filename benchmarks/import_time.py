"""What ``import jdp`` costs beyond ``import jax``: fresh processes, medians.

Each round starts a fresh interpreter that times ``import jax`` and then
``import jdp`` (which imports JAX, optax and numpy only; Orbax and rich wait
for their first use). The budget is 0.3 s over ``import jax``.
"""

import statistics
import subprocess
import sys

ROUNDS = 9
CODE = """
import time
t0 = time.perf_counter()
import jax
t1 = time.perf_counter()
import jdp
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def main() -> None:
    jax_s, jdp_s = [], []
    for _ in range(ROUNDS):
        out = subprocess.run(
            [sys.executable, "-c", CODE], capture_output=True, text=True, check=True
        )
        a, b = map(float, out.stdout.split())
        jax_s.append(a)
        jdp_s.append(b)
    extra = statistics.median(jdp_s)
    print(
        f"import jax {statistics.median(jax_s):.3f} s; import jdp after it +{extra:.3f} s "
        f"(median of {ROUNDS} fresh processes; budget +0.300 s: "
        f"{'within' if extra <= 0.3 else 'OVER'})"
    )


if __name__ == "__main__":
    main()
