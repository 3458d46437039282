"""What the framework callbacks (hf, lightning, megatron_bridge) share: the producer, made
from the TRAINMON_* environment on first use unless one is passed; a guard that keeps any
failure of monitoring out of the training loop; a config as JSON can hold it."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from ..producer import Producer, ProducerConfig

log = logging.getLogger("trainmon.integrations")


class ProducerOwner:
    """Mixed into each framework's callback class (which owns ``__init__``)."""

    def _use_producer(self, producer: Producer | None, settings: dict[str, Any]) -> None:
        # A misspelt setting fails here, where the callback is made (before training), not
        # at every step behind the guard.
        ProducerConfig.check_settings(settings)
        self._producer = producer
        self._own = producer is None
        self._settings = settings

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            self._producer = Producer(**self._settings)
        return self._producer

    def _guard(self, where: str, call) -> None:
        """Monitoring must never stop training: a failure here is logged, not raised."""
        try:
            call()
        except Exception:
            log.exception("trainmon: %s.%s failed (training goes on)", type(self).__name__, where)

    def close(self) -> None:
        """Close the producer this callback made itself (one passed in is the caller's)."""
        if self._own and self._producer is not None:
            self._producer.close()
            self._producer = None


def plain(value: Any, depth: int = 0) -> Any:
    """A config as JSON can hold it: dataclasses and dicts nested, anything else its repr."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if depth > 6:
        return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name, None), depth + 1) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value]
    return repr(value)
