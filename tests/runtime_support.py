"""A sink that keeps what it is given, for the consumer runtime's contract tests (on the
real broker: test_consumer_runtime.py; in memory: test_consumer_runtime_memory.py)."""

from __future__ import annotations

import gc
import time
from datetime import datetime, timezone

from trainmon.consumers import runtime
from trainmon.schemas import StepRecord, encode

FAST = runtime.RetryPolicy(first_s=0.01, max_s=0.05)


def step_values(n: int) -> list[bytes]:
    return [encode(StepRecord(run_id="rt", rank=0, world_size=1, host="h", time=datetime.now(timezone.utc),
                              event_id=f"rt-{i}", step=i, epoch=0, step_tokens=1, duration_ms=1,
                              loss=1, norm=1, lr=1)) for i in range(n)]


class ListSink(runtime.Sink):
    """Keeps what it was given; ``failures`` flushes raise RetriableError first, and
    ``on_flush`` sees the group's committed offsets at every flush attempt."""

    name = "list sink"

    def __init__(self, failures: int = 0, crash: bool = False, on_flush=None):
        self.failures, self.crash, self.on_flush = failures, crash, on_flush
        self.buffered: list = []
        self.flushed: list = []
        self.attempts = 0
        self.opened: list = []
        self.stopped = False

    def open(self, partitions):
        self.opened += partitions

    def put(self, messages):
        self.buffered += messages

    def flush_in_s(self):
        return 0.0 if self.buffered else None

    def flush(self):
        self.attempts += 1
        if self.on_flush:
            self.on_flush()
        if self.crash:
            raise RuntimeError("the sink's disk is gone")
        if self.failures:
            self.failures -= 1
            raise runtime.RetriableError("not now")
        self.flushed += self.buffered
        self.buffered = []

    def stop(self):
        self.stopped = True


def until_flushed(sink: ListSink, n: int, timeout: float = 30.0):
    deadline = time.monotonic() + timeout

    def done(_runtime) -> bool:
        assert time.monotonic() < deadline, f"flushed {len(sink.flushed)} of {n}"
        return len(sink.flushed) >= n
    return done


class StopOrderSink(ListSink):
    """Keeps the order of its close and stop calls."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def close(self, partitions):
        self.calls.append(("close", sorted(partitions)))

    def stop(self):
        self.calls.append(("stop",))
        super().stop()


class HoldingSink(ListSink):
    """Says everything from offset ``hold_at`` on is not written yet (as a sink writing in
    the background does until its writes land)."""

    def __init__(self, hold_at: int | None):
        super().__init__()
        self.hold_at = hold_at

    def pre_commit(self, positions):
        if self.hold_at is None:
            return positions
        return {tp: min(offset, self.hold_at) for tp, offset in positions.items()}


def _module_of(obj) -> str:
    func = getattr(obj, "__func__", obj)  # a bound method: its function's module
    module = getattr(func, "__module__", None) if callable(func) else None
    return module if isinstance(module, str) else type(obj).__module__


def cyclic_garbage(run, modules: tuple[str, ...]) -> list:
    """What ``run()`` left that only the cyclic garbage collector could free (the services
    run it rarely: consumers/gc_tuning.py): the unreachable objects found afterwards that
    are functions of ``modules`` (module names or their prefixes) or instances of their
    classes. Filtered because other tests' threads may still be making garbage meanwhile."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        return [o for o in gc.garbage if _module_of(o).startswith(modules)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
