"""Polling for a condition that other processes bring about (controllers, agents, operators)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    check: Callable[[], T],
    what: str,
    timeout: float,
    interval: float = 0.1,
    *,
    tolerate: tuple[type[BaseException], ...] = (),
) -> T:
    """Call `check` until it returns something truthy and return that.

    Exceptions of the types in `tolerate` count as "not yet" (an object that does not exist yet).
    After `timeout` seconds: AssertionError naming `what` and the last result, so that a test that
    polls fails with the reason in its message.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            last: object = check()
        except tolerate as error:
            last = error
        else:
            if last:
                return last  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")
        time.sleep(interval)
