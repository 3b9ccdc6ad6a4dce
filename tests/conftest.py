"""Test configuration: 8 CPU devices, forced once, before JAX starts.

Strict dtype promotion is not enabled: optax's own Adam (``decay ** count``)
fails under it. Warnings are errors (pyproject.toml).
"""

import jdp

jdp.force_cpu_devices(8)
