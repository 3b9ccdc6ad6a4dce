"""Host-side input: a deterministic batch iterator and device prefetching."""

import collections
import itertools
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jdp._args import check_bool, check_int, check_name
from jdp._batching import batch_size as leading_size
from jdp._batching import shard
from jdp._tree import PyTree
from jdp.distributed import check_initialized

REMAINDERS = ("drop", "pad")


class BatchIterator:
    """Deterministic, resumable mini-batches over a pytree of host arrays.

    Each epoch is a fresh permutation drawn from ``(seed, epoch)``, so a run
    that restores :meth:`get_state` continues with exactly the batches it
    would have seen. Like Chainer's iterators, ``epoch`` advances and
    ``is_new_epoch`` is True right after the batch that completes an epoch.

    Args:
      data: a pytree of NumPy arrays sharing a leading example axis.
      batch_size: the global batch size; a multiple of ``num_devices *
        process_count``.
      shuffle: draw a new permutation every epoch (else keep data order).
      seed: the shuffling seed, shared by every process.
      remainder: ``"drop"`` the last incomplete batch, or ``"pad"`` it with
        zeros to the full batch size; with ``"pad"`` every batch carries a
        boolean mask under ``mask_key`` (``data`` must then be a dict). The
        step reads no mask by itself: the loss leaves the padding out, e.g.
        ``jdp.weighted_mean(per_example, batch["mask"])``.
      repeat: run forever (training) or stop after one epoch (evaluation).
      num_devices: devices per process the batch is split over (default
        ``jax.local_device_count()``).
      process_index, process_count: this process's slice of every global
        batch; default ``jax.process_index()`` and ``jax.process_count()``.
        Every process shuffles alike.
      mask_key: the key of the padding mask (``remainder="pad"``).

    Example:
      >>> import numpy as np, jdp
      >>> it = jdp.BatchIterator({"x": np.arange(20)}, 8, shuffle=False, remainder="pad")
      >>> [int(b["mask"].sum()) for b in [next(it), next(it), next(it)]], it.epoch, it.is_new_epoch
      ([8, 8, 4], 1, True)
    """

    def __init__(
        self,
        data: PyTree,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        remainder: str = "drop",
        repeat: bool = True,
        num_devices: int | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
        mask_key: str = "mask",
    ):
        self.size = leading_size(data, "BatchIterator data")
        _check_batching(data, self.size, batch_size, remainder, repeat, mask_key)
        if process_index is None or process_count is None:
            check_initialized()  # else every process would read the same slice
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
        if not 0 <= process_index < process_count:
            raise ValueError(
                f"jdp.BatchIterator: process_index must be in [0, {process_count}), got {process_index}."
            )
        num_devices = jax.local_device_count() if num_devices is None else num_devices
        split = num_devices * process_count
        if batch_size % split:
            raise ValueError(
                f"jdp.BatchIterator: batch_size={batch_size} is not divisible by the "
                f"{split} devices it is split over ({num_devices} per process x "
                f"{process_count} process(es)); use a multiple of {split}."
            )
        self.data = jax.tree.map(np.asarray, data)
        self.batch_size = batch_size
        self.shuffle = check_bool(shuffle, "shuffle", where="jdp.BatchIterator")
        self.seed = check_int(seed, "seed", minimum=0, where="jdp.BatchIterator")
        self.remainder = remainder
        self.repeat = repeat
        self.mask_key = mask_key
        self.fingerprint = _fingerprint(self.data)
        self.process_index = process_index
        self.process_count = process_count
        self.epoch = 0
        self.iteration = 0
        self.is_new_epoch = False
        self._position = 0
        self._permutation = (-1, np.arange(0))  # (epoch, order), drawn once per epoch

    @property
    def batches_per_epoch(self) -> int:
        if self.remainder == "drop":
            return self.size // self.batch_size
        return -(-self.size // self.batch_size)

    def _order(self, epoch: int) -> np.ndarray:
        if self._permutation[0] != epoch:
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(self.size)
                if self.shuffle
                else np.arange(self.size)
            )
            self._permutation = (epoch, order)
        return self._permutation[1]

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> PyTree:
        if not self.repeat and (self.epoch > 0 or self.size == 0):
            raise StopIteration
        start = self._position * self.batch_size
        indices = self._order(self.epoch)[start : start + self.batch_size]
        real = len(indices)
        local = self.batch_size // self.process_count
        lo, hi = self.process_index * local, (self.process_index + 1) * local
        mine = indices[lo:hi]
        batch = jax.tree.map(lambda x: _take_padded(x, mine, local), self.data)
        if self.remainder == "pad":
            batch = {**batch, self.mask_key: np.arange(lo, hi) < real}
        self._position += 1
        self.iteration += 1
        self.is_new_epoch = self._position == self.batches_per_epoch
        if self.is_new_epoch:
            self.epoch += 1
            self._position = 0
        return batch

    def get_state(self) -> dict[str, Any]:
        """A JSON-able position, for ``Checkpointer.save(..., extra=...)``."""
        return {
            "epoch": self.epoch,
            "position": self._position,
            "iteration": self.iteration,
            "seed": self.seed,
            "size": self.size,
            "batch_size": self.batch_size,
            "fingerprint": self.fingerprint,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continues from a :meth:`get_state` of an iterator over the same data.

        Raises:
          ValueError: the state is not a full :meth:`get_state`, or it was
            taken over other data, another batch size or another seed.
        """
        missing = sorted(set(self.get_state()) - set(state)) if isinstance(state, Mapping) else None
        if missing is None or missing:
            raise ValueError(
                "BatchIterator.set_state expects a dict from get_state(); "
                + (f"got {type(state).__name__}." if missing is None else f"it lacks {missing}.")
            )
        for key in ("seed", "size", "batch_size", "fingerprint"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"jdp.BatchIterator.set_state: saved {key}={state[key]} but this "
                    f"iterator has {key}={getattr(self, key)}; resume over the same "
                    "data, batch size and seed."
                )
        self.epoch = int(state["epoch"])
        self._position = int(state["position"])
        self.iteration = int(state["iteration"])
        self.is_new_epoch = False


def _check_batching(
    data: PyTree, size: int, batch_size: object, remainder: str, repeat: bool, mask_key: str
) -> None:
    """BatchIterator's options, checked against the data (the process split aside)."""
    batch_size = check_int(batch_size, "batch_size", minimum=1, where="jdp.BatchIterator")
    check_bool(repeat, "repeat", where="jdp.BatchIterator")  # "no" would read as True
    check_name(mask_key, "mask_key", where="jdp.BatchIterator")
    if remainder not in REMAINDERS:
        raise ValueError(
            f"jdp.BatchIterator: remainder must be one of {REMAINDERS}, got {remainder!r}."
        )
    if remainder == "pad" and not (isinstance(data, Mapping) and mask_key not in data):
        raise ValueError(
            f'BatchIterator(remainder="pad") adds a {mask_key!r} entry, so data must be a '
            f"dict without that key; got {type(data).__name__}"
            + (f" with keys {sorted(data)}" if isinstance(data, Mapping) else "")
            + ". Choose another name with mask_key=..."
        )
    if size == 0 and repeat:
        raise ValueError(
            "jdp.BatchIterator: data holds 0 examples, so a repeating iterator would never "
            "yield a batch; pass data with examples (or repeat=False for an empty pass)."
        )
    if remainder == "drop" and size < batch_size:
        raise ValueError(
            f"jdp.BatchIterator: {size} examples make no full batch of {batch_size}; "
            'use remainder="pad" or a smaller batch.'
        )


def _fingerprint(data: PyTree) -> int:
    """A checksum of the data's structure and of up to 1,024 evenly spaced examples.

    Cheap for any data size, and enough to refuse a position saved over other
    data of the same size.
    """
    leaves, treedef = jax.tree.flatten(data)
    size = leaves[0].shape[0] if leaves else 0
    rows = np.unique(np.linspace(0, max(size - 1, 0), num=min(size, 1024), dtype=np.int64))
    crc = zlib.crc32(str(treedef).encode())
    for leaf in leaves:
        crc = zlib.crc32(f"{leaf.shape}{leaf.dtype}".encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(leaf[rows]).tobytes(), crc)
    return crc


def _take_padded(x: np.ndarray, indices: np.ndarray, size: int) -> np.ndarray:
    if len(indices) == size:
        return x[indices]
    out = np.zeros((size, *x.shape[1:]), x.dtype)
    out[: len(indices)] = x[indices]
    return out


def prefetch_to_device(
    iterator: Iterable[PyTree],
    size: int = 2,
    shard_fn: Callable[[PyTree], PyTree] = shard,
) -> Iterator[PyTree]:
    """Shards and places the next ``size`` batches while the current step runs.

    Device transfers are asynchronous, so keeping ``size`` batches in flight
    overlaps input copies with computation.

    Args:
      iterator: host batches.
      size: batches placed ahead, >= 1.
      shard_fn: how to place a batch: ``jdp.shard`` (pmap layout) or a wrapped
        step's ``shard`` method (e.g. ``jdp.shard_map(...).shard``).

    Example:
      >>> import numpy as np, jdp
      >>> batches = [{"x": np.full((8, 2), i, np.float32)} for i in range(3)]
      >>> [float(b["x"][0, 0, 0]) for b in jdp.prefetch_to_device(batches)]
      [0.0, 1.0, 2.0]
    """
    check_int(size, "size", minimum=1, where="jdp.prefetch_to_device")
    if not isinstance(iterator, Iterable):
        raise TypeError(
            "jdp.prefetch_to_device takes an iterable of host batches (a jdp.BatchIterator, a "
            f"generator, a data loader), got {type(iterator).__name__}."
        )
    iterator = iter(iterator)
    queue: collections.deque = collections.deque()

    def enqueue(n):
        for batch in itertools.islice(iterator, n):
            queue.append(shard_fn(batch))

    enqueue(size)
    while queue:
        yield queue.popleft()
        enqueue(1)
