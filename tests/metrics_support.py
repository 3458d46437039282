"""Reading a service's Prometheus endpoint the way Prometheus does (its text format,
parsed by prometheus-client's own parser), and a sink served in the background."""

from __future__ import annotations

import queue
import threading
import urllib.request
from contextlib import contextmanager
from typing import Iterator

from prometheus_client.parser import text_string_to_metric_families

from trainmon.consumers import serving


class Samples(dict):
    """(sample name, frozenset of label items) -> value, from one scrape."""

    def value(self, name: str, default: float | None = 0.0, **labels: str) -> float | None:
        return self.get((name, frozenset(labels.items())), default)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {dict(key)[label]: v for (n, key), v in self.items() if n == name and label in dict(key)}


def scrape(port: int, host: str = "127.0.0.1") -> Samples:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return Samples({(s.name, frozenset(s.labels.items())): s.value
                    for family in text_string_to_metric_families(text) for s in family.samples})


@contextmanager
def served(sink, **serve_options) -> Iterator[int]:
    """``serving.serve(sink, metrics_port=0, ...)`` on a thread until the block ends; yields
    the metrics port. The runtime is ``sink.context`` 's."""
    stop = threading.Event()
    ports: queue.Queue = queue.Queue()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            serving.serve(sink, stop=stop, metrics_port=0, on_started=lambda rt: ports.put(rt.metrics.port),
                          **serve_options)
        except BaseException as exc:  # the test thread reports it
            failed.append(exc)
            ports.put(None)

    thread = threading.Thread(target=run, name="served-sink", daemon=True)
    thread.start()
    try:
        port = ports.get(timeout=30)
        if port is None:
            raise AssertionError(f"the sink did not start: {failed[0]!r}") from failed[0]
        yield port
    finally:
        stop.set()
        thread.join(30)
    if failed:
        raise failed[0]
