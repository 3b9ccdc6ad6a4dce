"""A TensorBoard writer for :func:`jdp.fit`, on tensorboardX (``pip install jdp[tensorboard]``)."""

import numbers
import pathlib
from typing import Any


class TensorBoardLogger:
    """A ``fit`` callback that writes every logged row's scalars to TensorBoard.

    Train rows go under ``train/<metric>``, evaluation rows under
    ``eval/<metric>``, at the row's ``step``; per-replica lists are skipped.
    Only process 0 writes.

    Args:
      logdir: the event-file directory (``tensorboard --logdir`` it).

    Example:
      >>> import tempfile, jdp
      >>> logger = jdp.TensorBoardLogger(tempfile.mkdtemp())
      >>> logger({"split": "train", "step": 10, "loss": 0.5, "loss_per_replica": [0.4, 0.6]})
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
        self.logdir = pathlib.Path(logdir)
        self._writer = SummaryWriter(str(self.logdir)) if jax.process_index() == 0 else None

    def __call__(self, row: dict[str, Any]) -> None:
        if self._writer is None:
            return
        split = row.get("split", "train")
        for name, value in row.items():
            if name in ("step", "split") or isinstance(value, bool):
                continue
            if isinstance(value, numbers.Real):
                self._writer.add_scalar(f"{split}/{name}", float(value), row["step"])
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
