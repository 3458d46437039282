"""One way for a test to wait for a condition: ``wait_until(condition, timeout, what)``.

A test waits for what it needs (a count reached, a file written, a service's log line),
never for a fixed time standing in for it: a fixed sleep is too short on a busy machine
and too long everywhere else.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 30.0, what: str = "the condition", *,
               pause: float = 0.01, details: Callable[[], str] | None = None) -> T:
    """Call ``condition`` every ``pause`` seconds until it returns something true, and
    return that; fail the test, naming ``what`` (and ``details()``), after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}"
                                 + (f": {details()}" if details else ""))
        time.sleep(pause)
    return value
