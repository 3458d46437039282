"""``serve(sink)``: a sink on the consumer runtime, over the records it declares.

A sink (:class:`.runtime.Sink`) says what it reads -- ``group``, ``kinds``,
``undecoded_kinds``, ``consumer_settings`` -- and when a catch-up job may end
(``quiet_for``). The wiring is the same for every consumer, so it lives here once:

    runtime = attach(sink, topic_prefix=..., stop=stop_on_signals())   # stream + runtime
    runtime.run(until)                                                    # or, in one call:
    serve(sink, exit_when_idle_s=3.0)

``attach`` is for a caller that drives the runtime itself (tests stepping it, a replay
whose end depends on the stream); everything else calls ``serve``. ``serve(sink,
metrics_port=PORT)`` also serves the runtime's metrics (:mod:`.metrics`) while it runs;
each service's command line takes ``--metrics-port`` (:func:`add_metrics_arguments`).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from typing import Any, Callable, Mapping

from .metrics import DEFAULT_LISTEN
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
          until: Callable[[SinkRuntime], bool] | None = None, metrics_port: int | None = None,
          metrics_listen: str = DEFAULT_LISTEN, on_started: Callable[[SinkRuntime], None] | None = None,
          **attach_options) -> SinkRuntime:
    """Attach the sink (see :func:`attach` for the options) and run it until stopped, or
    until ``until`` holds, or, with ``exit_when_idle_s``, until the sink is quiet that long;
    the runtime then flushes, commits, stops the sink and closes the stream. Returns the
    runtime, for its counts. ``metrics_port`` (0: a free one): its metrics served there
    meanwhile, at ``metrics_listen``; ``on_started(runtime)`` is called once they are (a
    test learns the port there)."""
    runtime = attach(sink, **attach_options)
    log.info("trainmon: %s reads %s* as group %s", sink.name, runtime.stream.prefix,
             runtime.stream.group_id)
    if metrics_port is not None:
        runtime.metrics.serve(metrics_port, metrics_listen)
    try:
        if on_started is not None:
            on_started(runtime)
        runtime.run(until or idle_exit(sink, exit_when_idle_s))
    finally:
        runtime.close()  # (run closes it; on_started may have raised)
        runtime.metrics.close()
    return runtime


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-listen``, the same for every consumer;
    ``metrics_options(args)`` gives them to :func:`serve`."""
    # (A default given as a string goes through ``type``: a bad $TRAINMON_METRICS_PORT is
    # argparse's usage error naming the option, not a traceback.)
    parser.add_argument("--metrics-port", type=int, default=os.environ.get("TRAINMON_METRICS_PORT") or None,
                        metavar="PORT",
                        help="serve Prometheus metrics at http://ADDR:PORT/metrics (0: a free port, "
                             "logged; default: $TRAINMON_METRICS_PORT, else none; docs/metrics.md)")
    parser.add_argument("--metrics-listen", default=os.environ.get("TRAINMON_METRICS_LISTEN", DEFAULT_LISTEN),
                        metavar="ADDR", help="the metrics endpoint's address (default: "
                                             "$TRAINMON_METRICS_LISTEN or %(default)s)")


def metrics_options(args: argparse.Namespace) -> dict:
    """:func:`serve`'s metrics options from :func:`add_metrics_arguments`'."""
    return {"metrics_port": args.metrics_port, "metrics_listen": args.metrics_listen}


def add_exit_when_idle_argument(parser: argparse.ArgumentParser,
                                help: str = "exit once no record arrived for this long "
                                            "(catch-up / replay jobs)") -> None:
    """``--exit-when-idle SECONDS``, the same for every consumer; ``args.exit_when_idle_s``."""
    parser.add_argument("--exit-when-idle", dest="exit_when_idle_s", type=float, default=None,
                        metavar="SECONDS", help=help)
