"""Host code a compiled step is running now: ``jax.debug.callback``, ``pure_callback``, ``io_callback``.

A process whose step is stuck in such a callback never reaches the step's
collectives, so its peers wait inside the same step and every process shows
the same step calls: only the callback, seen from Python, tells which one
holds the job. The watchdog thread asks :func:`running` each time it
publishes this process's progress.
"""

import os
import sys
from types import FrameType

# JAX enters every host callback through this module (``_wrapped_callback``).
_ENTRY = os.path.join("jax", "_src", "callback.py")
_LIBRARIES = (os.sep + "jax" + os.sep, os.sep + "jdp" + os.sep)


def running() -> str | None:
    """Where a host callback runs now, ``file:line in name`` of the user's callback, or None.

    When the callback waits deeper (in ``threading``, say), that frame is
    named too. Reads every thread's Python stack; no thread is stopped.

    Example:
      >>> from jdp import _host_callbacks
      >>> _host_callbacks.running() is None  # no step is running here
      True
    """
    for frame in list(sys._current_frames().values()):
        stack = _outermost_first(frame)
        entered = next(
            (i for i, f in enumerate(stack) if f.f_code.co_filename.endswith(_ENTRY)), None
        )
        if entered is None:
            continue
        user = [f for f in stack[entered + 1 :] if not _in_libraries(f)]
        if not user:
            return "a host callback"
        where = _name(user[0])
        if stack[-1] is not user[0]:
            where += f", now at {_name(stack[-1])}"
        return where
    return None


def _outermost_first(frame: FrameType | None) -> list[FrameType]:
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    return stack[::-1]


def _in_libraries(frame: FrameType) -> bool:
    return any(part in frame.f_code.co_filename for part in _LIBRARIES)


def _name(frame: FrameType) -> str:
    return (
        f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
    )
