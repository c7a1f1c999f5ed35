"""Child processes that never outlive their owner, even when the owner is SIGKILLed."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, never between fork and exec


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn` that makes the child receive SIGKILL when the thread that forked it ends.

    Linux delivers PR_SET_PDEATHSIG when the forking *thread* exits, so fork from a thread that
    outlives the child (the main thread). `parent_pid` is `os.getpid()` of the owner, taken before
    the fork: if the owner died before prctl took effect, the child exits at once.
    """

    def preexec() -> None:  # runs in the child between fork and exec: no allocation-heavy work
        if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent_pid:
            os._exit(126)

    return preexec
