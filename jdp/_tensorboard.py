"""A TensorBoard writer for :func:`jdp.fit`, on tensorboardX (``pip install jdp[tensorboard]``)."""

import numbers
import os
import pathlib
from typing import Any


class TensorBoardLogger:
    """A ``fit`` callback that writes every logged row's scalars to TensorBoard.

    Train rows go under ``train/<metric>``, evaluation rows under
    ``eval/<metric>``, at the row's ``step``. A flat list of integers (a
    state fingerprint, :func:`jdp.metrics.fingerprint`) is written as text,
    exactly (a scalar summary is a float32, which would round it); other
    lists (per-replica values, per-leaf fingerprints) are skipped. Only
    process 0 writes.

    Args:
      logdir: the event-file directory (``tensorboard --logdir`` it).

    Example:
      >>> import tempfile, jdp
      >>> logger = jdp.TensorBoardLogger(tempfile.mkdtemp())
      >>> logger({"split": "train", "step": 10, "loss": 0.5, "loss_per_replica": [0.4, 0.6],
      ...         "fingerprint": [3735928559, 4276992702]})
      >>> logger.close()
    """

    def __init__(self, logdir: str | pathlib.Path):
        import jax

        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "jdp.TensorBoardLogger needs tensorboardX: pip install 'jdp[tensorboard]'."
            ) from e
        if not isinstance(logdir, str | os.PathLike):
            raise TypeError(
                "jdp.TensorBoardLogger: logdir must be a path (str or pathlib.Path), the folder "
                f"tensorboard --logdir reads, got {type(logdir).__name__}."
            )
        self.logdir = pathlib.Path(logdir)
        self._writer = SummaryWriter(str(self.logdir)) if jax.process_index() == 0 else None

    def __call__(self, row: dict[str, Any]) -> None:
        if not isinstance(row, dict) or "step" not in row:
            raise TypeError(
                "jdp.TensorBoardLogger: a row is a dict with a 'step' entry, as jdp.fit passes "
                f"to its callbacks (callbacks=[logger]), got {_describe(row)}."
            )
        if self._writer is None:
            return
        split = row.get("split", "train")
        for name, value in row.items():
            if name in ("step", "split") or isinstance(value, bool):
                continue
            if isinstance(value, numbers.Real):
                self._writer.add_scalar(f"{split}/{name}", float(value), row["step"])
            elif isinstance(value, dict):  # a train row's time: seconds by kind
                for key, seconds in value.items():
                    self._writer.add_scalar(f"{split}/{name}/{key}", float(seconds), row["step"])
            elif _integers(value):
                text = " ".join(str(v) for v in value)
                self._writer.add_text(f"{split}/{name}", text, row["step"])
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _describe(row: object) -> str:
    return (
        f"a dict with keys {sorted(map(str, row))}"
        if isinstance(row, dict)
        else f"a {type(row).__name__}"
    )


def _integers(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )
