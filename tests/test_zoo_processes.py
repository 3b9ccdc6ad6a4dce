"""Exact mode on the model zoo across processes: 2 processes x 2 devices equal 1 x 4, bitwise.

Its own file, so that ``make test`` can hand it to one worker and the zoo's
device-count sweep (tests/test_zoo.py) to the other, and so that
``make test-floor`` (the single-process suites, again on the oldest
supported JAX) leaves it out.
"""

import numpy as np

from tests import models, zoo


def test_zoo_on_two_processes_of_two_devices_equals_one_of_four(tmp_path):
    out = {}
    for processes, devices in [(2, 2), (1, 4)]:  # each run trains under both backends
        path = tmp_path / f"{processes}x{devices}.npz"
        models.launch("multiprocess_zoo.py", processes, devices, path, timeout=400)
        out[processes] = np.load(path)
    names = {tuple(name.split("/")[:2]) for name in out[1].files}
    assert names == {(b, f) for b, families in zoo.ACROSS_PROCESSES.items() for f in families}
    # The U-Net too: its depthwise conv's kernel gradient follows the CPU pool size,
    # which jdp.distributed.initialize sizes by the job's devices (docs/exact.md).
    assert set(zoo.ACROSS_PROCESSES["shard_map"]) == set(zoo.FAMILIES)
    for name in out[1].files:
        np.testing.assert_array_equal(out[1][name], out[2][name], err_msg=name)
    # and the two backends agree across processes too
    for name in (n for n in out[2].files if n.startswith("pmap/")):
        shard_map_name = "shard_map/" + name.removeprefix("pmap/")
        np.testing.assert_array_equal(out[2][name], out[2][shard_map_name], err_msg=name)
