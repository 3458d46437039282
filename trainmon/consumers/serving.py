"""``serve(sink)``: a sink on the consumer runtime, over the records it declares.

A sink (:class:`.runtime.Sink`) says what it reads -- ``group``, ``kinds``,
``undecoded_kinds``, ``consumer_settings`` -- and when a catch-up job may end
(``quiet_for``). The wiring is the same for every consumer, so it lives here once:

    runtime = attach(sink, topic_prefix=..., stop=stop_on_signals())   # stream + runtime
    runtime.run(until)                                                    # or, in one call:
    serve(sink, exit_when_idle_s=3.0)

``attach`` is for a caller that drives the runtime itself (tests stepping it, a replay
whose end depends on the stream); everything else calls ``serve``.
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import Any, Callable, Mapping

from .runtime import RetryPolicy, Sink, SinkRuntime
from .stream import RecordStream

log = logging.getLogger("trainmon.consumers")


def attach(sink: Sink, *, group: str | None = None, topic_prefix: str | None = None,
           env: dict | None = None, stop: threading.Event | None = None,
           retry: RetryPolicy | None = None,
           consumer_settings: Mapping[str, Any] | None = None,
           open_stream: Callable[..., RecordStream] = RecordStream) -> SinkRuntime:
    """The sink on a runtime over the stream it declares, joined but not yet polled.
    ``group`` and ``consumer_settings`` override the sink's own (a replay's throwaway group,
    an operator's static member id). ``open_stream`` takes RecordStream's arguments and
    returns the stream (a test's ``memory_stream.memory_streams(broker)``)."""
    settings = {**sink.consumer_settings, **(consumer_settings or {})}
    stream = open_stream(group or sink.group, sink.kinds, topic_prefix=topic_prefix, env=env,
                         undecoded_kinds=sink.undecoded_kinds, **settings)
    try:
        # The sink starts here (Sink.start): one restoring its state may fail, and the
        # stream it joined with must then leave its group and free its instance id.
        return SinkRuntime(sink, stream, stop=stop, retry=retry)
    except BaseException:
        stream.close()
        raise


def idle_exit(sink: Sink, exit_when_idle_s: float | None) -> Callable[[SinkRuntime], bool] | None:
    """The runtime's ``until`` for ``exit_when_idle_s`` (None: run until stopped)."""
    if exit_when_idle_s is None:
        return None
    return lambda runtime: sink.quiet_for(runtime, exit_when_idle_s)


def serve(sink: Sink, *, exit_when_idle_s: float | None = None,
          until: Callable[[SinkRuntime], bool] | None = None, **attach_options) -> SinkRuntime:
    """Attach the sink (see :func:`attach` for the options) and run it until stopped, or
    until ``until`` holds, or, with ``exit_when_idle_s``, until the sink is quiet that long;
    the runtime then flushes, commits, stops the sink and closes the stream. Returns the
    runtime, for its counts."""
    runtime = attach(sink, **attach_options)
    log.info("trainmon: %s reads %s* as group %s", sink.name, runtime.stream.prefix,
             runtime.stream.group_id)
    runtime.run(until or idle_exit(sink, exit_when_idle_s))
    return runtime


def add_exit_when_idle_argument(parser: argparse.ArgumentParser,
                                help: str = "exit once no record arrived for this long "
                                            "(catch-up / replay jobs)") -> None:
    """``--exit-when-idle SECONDS``, the same for every consumer; ``args.exit_when_idle_s``."""
    parser.add_argument("--exit-when-idle", dest="exit_when_idle_s", type=float, default=None,
                        metavar="SECONDS", help=help)
