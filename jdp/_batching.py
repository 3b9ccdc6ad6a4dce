"""Splitting a global batch along a leading device axis, and back."""

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp._args import check_int
from jdp._tree import PyTree

AXIS_NAME = "batch"

# The mesh axis of the pmap layout's arrays (a leading device axis). It is not
# a data axis name: a pmap-layout batch (n, B // n, ...) and a global batch of
# n examples then differ in their sharding, not only in a shape that can agree.
DEVICE_AXIS = "devices"


def local_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh of the pmap layout over ``devices`` (default: the local devices)."""
    devices = (
        jax.local_devices()
        if devices is None
        else device_list(devices, "jdp.replicate or jdp.shard")
    )
    return Mesh(np.asarray(devices), (DEVICE_AXIS,))


def device_list(devices: Sequence[jax.Device], where: str) -> list[jax.Device]:
    """``devices`` as a list, refused when empty or when it names a device twice.

    Example:
      >>> import jax
      >>> len(device_list(jax.devices()[:2], "jdp.pmap"))
      2
    """
    devices = list(devices)  # once: an iterator would be empty the second time
    if not devices:
        raise ValueError(
            f"{where}: devices is empty: pass at least one device (default: every local device)."
        )
    seen: dict[jax.Device, int] = {}
    for i, device in enumerate(devices):
        if not isinstance(device, jax.Device):
            raise TypeError(
                f"{where}: devices[{i}] is a {type(device).__name__}, not a jax.Device; pass "
                "devices from jax.devices() or jax.local_devices()."
            )
        if device in seen:
            raise ValueError(
                f"{where}: devices holds {device} twice (at {seen[device]} and {i}); "
                "each replica needs a device of its own: pass distinct devices."
            )
        seen[device] = i
    return devices


def device_axis_sharding(devices: Sequence[jax.Device] | None = None) -> NamedSharding:
    """Row i of a leading device axis on device i: the pmap layout."""
    return NamedSharding(local_mesh(devices), PartitionSpec(DEVICE_AXIS))


def leaves_with_paths(tree: PyTree, what: str) -> list[tuple[str, jax.Array]]:
    """``(path, leaf)`` pairs, with a TypeError for leaves that are not arrays."""
    pairs = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path) or "<root>"
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            _refuse_records(tree, what)
            in_list = any(isinstance(k, jax.tree_util.SequenceKey) for k in path)
            fix = (
                "It sits in a Python list: convert the list with np.asarray (lists of "
                "unequal lengths, ragged, must first be padded to one length)."
                if in_list and isinstance(leaf, (int, float, bool, complex))
                else "Convert it with np.asarray or move it out of the batch."
            )
            raise TypeError(
                f"{what} must be a pytree of arrays, but leaf {name} is a "
                f"{type(leaf).__name__} ({leaf!r:.60}). {fix}"
            )
        pairs.append((name, leaf))
    return pairs


def batch_size(tree: PyTree, what: str) -> int:
    """The leading dimension shared by every leaf of ``tree``.

    Raises:
      TypeError: a leaf is not an array.
      ValueError: a leaf is a scalar, the tree is empty, or two leaves
        disagree; the message names both leaves.
    """
    # The per-step fast path: leaf paths are only built to explain a failure.
    leaves = jax.tree.leaves(tree)
    if leaves and all(hasattr(x, "dtype") and getattr(x, "ndim", 0) > 0 for x in leaves):
        size = leaves[0].shape[0]
        if all(x.shape[0] == size for x in leaves):
            return size
    _refuse_records(tree, what)
    pairs = leaves_with_paths(tree, what)
    if not pairs:
        raise ValueError(f"{what} has no array leaves; got {tree!r:.80}.")
    first_name, first = pairs[0]
    for name, leaf in pairs:
        if leaf.ndim == 0:
            raise ValueError(
                f"{what} leaf {name} is a scalar; every leaf needs a leading batch dimension."
            )
        if leaf.shape[0] != first.shape[0]:
            raise ValueError(
                f"{what} leaves disagree on the batch size: {first_name} has "
                f"{first.shape[0]} examples (shape {first.shape}) but {name} "
                f"has {leaf.shape[0]} (shape {leaf.shape})."
            )
    return first.shape[0]


def _refuse_records(tree: PyTree, what: str) -> None:
    """A list of per-example dicts (what a dataset's rows look like) is not a batch."""
    if not isinstance(tree, (list, tuple)) or len(tree) < 2:
        return
    if all(isinstance(x, Mapping) and x.keys() == tree[0].keys() for x in tree):
        raise TypeError(
            f"{what} is a {type(tree).__name__} of {len(tree)} dicts, one per example? jdp "
            "takes one dict of arrays with a leading batch axis: stack the examples with "
            "jax.tree.map(lambda *xs: np.stack(xs), *examples)."
        )


def divisible_batch_size(tree: PyTree, n: int, what: str) -> int:
    """The batch size ``B`` of ``tree``, checked to split over ``n`` devices."""
    size = batch_size(tree, f"{what}: the batch")
    if size % n:
        _refuse_records(tree, f"{what}: the batch")
        name = leaves_with_paths(tree, f"{what}: the batch")[0][0]
        raise ValueError(
            f"{what}: cannot shard batch leaf {name} with B={size} examples over n={n} "
            f"devices: B % n = {size % n}. Use a batch size divisible by {n}, "
            "or pad it with `batch, mask = jdp.pad_batch(batch, n)` and leave the "
            "padding out of the loss with jdp.weighted_mean(per_example_loss, mask)."
        )
    return size


def shard(tree: PyTree, devices: Sequence[jax.Device] | None = None) -> PyTree:
    """Splits a global batch into one contiguous block per local device.

    Every leaf of shape ``(B, ...)`` becomes ``(n, B // n, ...)``, placed so
    that block ``i`` lives on device ``i``: the layout ``jax.pmap`` consumes.

    Args:
      tree: a pytree of arrays sharing the leading batch dimension ``B``.
      devices: the devices to split over (default: ``jax.local_devices()``).

    Returns:
      The same pytree with leaves of shape ``(n, B // n, ...)``.

    Raises:
      ValueError: ``B`` is not divisible by ``n`` (pad with
        :func:`jdp.pad_batch`), or leaves disagree on ``B``.
      TypeError: a leaf is not an array.

    Example:
      >>> import numpy as np, jdp
      >>> jdp.shard({"x": np.zeros((16, 3))})["x"].shape
      (8, 2, 3)
    """
    return shard_blocks(tree, device_axis_sharding(devices))


def shard_blocks(tree: PyTree, sharding: NamedSharding, what: str = "jdp.shard") -> PyTree:
    """:func:`shard` onto the devices of a prebuilt 1-D ``sharding`` (built once per step)."""
    n = sharding.mesh.size
    refuse_placed(tree, what)
    size = divisible_batch_size(tree, n, what)
    return jax.tree.map(
        lambda x: jax.device_put(x.reshape((n, size // n) + x.shape[1:]), sharding),
        tree,
    )


def refuse_placed(tree: PyTree, what: str, allowed: NamedSharding | None = None) -> None:
    """Refuses a batch already spread over devices (sharded once already), naming the leaf."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(x, jax.Array) or len(x.sharding.device_set) < 2:
            continue
        if allowed is not None and x.sharding == allowed:
            continue
        raise ValueError(
            f"{what}: batch leaf {jax.tree_util.keystr(path) or '<root>'} (shape {x.shape}) is "
            f"already spread over {len(x.sharding.device_set)} devices: the batch was sharded "
            "already (by jdp.shard or a step's shard, perhaps of the other backend). Pass the "
            "host batch; jdp.unshard turns a pmap-layout batch back into one."
        )


def unshard(tree: PyTree) -> PyTree:
    """Merges the leading device axis back: ``(n, b, ...)`` -> ``(n * b, ...)``.

    Example:
      >>> import numpy as np, jdp
      >>> jdp.unshard({"x": np.zeros((8, 2, 3))})["x"].shape
      (16, 3)
    """
    for name, leaf in leaves_with_paths(tree, "jdp.unshard: the input"):
        if leaf.ndim < 2:
            raise ValueError(
                f"jdp.unshard expects leaves of shape (n, b, ...), but {name} has shape {leaf.shape}."
            )
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)


def pad_batch(tree: PyTree, multiple: int) -> tuple[PyTree, np.ndarray]:
    """Pads a batch with zeros to a multiple of ``multiple`` examples.

    Returns the padded batch and a boolean mask, True for real examples. Put
    the mask in the batch and return ``jdp.weighted_mean(per_example, mask)``
    from the loss: the step then weights every
    replica by its number of real examples (see :func:`jdp.make_train_step`).

    Example:
      >>> import numpy as np, jdp
      >>> padded, mask = jdp.pad_batch({"x": np.ones((5, 2))}, 4)
      >>> padded["x"].shape, mask.tolist()
      ((8, 2), [True, True, True, True, True, False, False, False])
    """
    check_int(multiple, "multiple", minimum=1, where="jdp.pad_batch")
    size = batch_size(tree, "jdp.pad_batch: the batch")
    padded = -(-size // multiple) * multiple
    mask = np.arange(padded) < size

    def pad(x):
        x = np.asarray(x)
        return np.concatenate([x, np.zeros((padded - size,) + x.shape[1:], x.dtype)])

    return jax.tree.map(pad, tree), mask
