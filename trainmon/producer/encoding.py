"""Queued records -> Kafka entries (topic, key, JSON): the sender thread's encoding.

A log call's numbers (a ``DeferredRecord``, see deferred.py) are written without
pydantic; anything else goes through the model. One record that cannot be built or
encoded, or is too big for one Kafka message, is rejected alone (counted and logged by
``on_reject``): never an exception that ends the sender thread.
"""

from __future__ import annotations

import json
import logging
import typing
from functools import lru_cache
from typing import Any, Callable

from ..kafka_client.transport import Entry
from ..schemas import Record, encode
from ..schemas.jsonsafe import json_safe
from .deferred import DeferredRecord

log = logging.getLogger("trainmon.producer")

Observer = Callable[[Record], None]
Rejecter = Callable[[Record, str], None]


class Encoder:
    def __init__(self, observers: list[Observer], max_record_bytes: int, on_reject: Rejecter):
        self.observers = observers
        # Kafka refuses a message over its size limit on every retry: such a record would
        # sit at the head of the spill file and hold back every record behind it.
        self.max_record_bytes = max_record_bytes
        self._on_reject = on_reject

    def queued(self, item: tuple) -> Entry | None:
        topic, key = item[0], item[1]
        record = item[2] if len(item) == 3 else DeferredRecord.from_queued(item[2:])
        if not self.observers:
            return self.entry(topic, key, record)
        encoded = self._encoded(record)
        if encoded is None:
            return None
        record, value = encoded  # the observers see what Kafka gets
        for observe in self.observers:
            try:
                observe(record)
            except Exception:  # a local log sink must never cost a record
                log.exception("trainmon: local log sink failed")
        return self._checked(topic, key, record, value)

    def entry(self, topic: str, key: bytes, record: Record | DeferredRecord | tuple) -> Entry | None:
        """The message of one record (the observers not told), or None once it is rejected."""
        if type(record) is tuple:
            record = DeferredRecord.from_queued(record)
        if type(record) is DeferredRecord and not self.observers:
            # A log call's numbers, written without pydantic: the path of nearly every
            # record of a training loop, kept short (it runs with cold caches).
            try:
                value = record.encode()
            except Exception as exc:  # (the quick check vouched for its fields)
                self._reject(record, f"{type(exc).__name__}: {exc}")
                return None
            if len(value) <= self.max_record_bytes:
                return topic, key, value
            return self._checked(topic, key, record, value)
        encoded = self._encoded(record)
        return None if encoded is None else self._checked(topic, key, *encoded)

    def _encoded(self, record: Record | DeferredRecord) -> tuple[Record, bytes] | None:
        """The record and its JSON, or None once it is rejected: one record that cannot
        be built or encoded is counted and logged, never an exception that ends the
        sender thread."""
        if type(record) is DeferredRecord:
            try:
                record = record.build()  # (the observers are handed records)
            except Exception as exc:  # (the quick check vouched for its fields)
                self._reject(record, f"{type(exc).__name__}: {exc}")
                return None
        try:
            return encode_safely(record)
        except Exception as exc:
            self._reject(record, f"cannot be written as JSON: {type(exc).__name__}: {exc}")
            return None

    def _checked(self, topic: str, key: bytes, record: Record, value: bytes) -> Entry | None:
        if len(value) > self.max_record_bytes:
            if type(record) is DeferredRecord:
                record = record.build()  # (numbers only: never this large in practice)
            self._reject(record, too_large(record, len(value), self.max_record_bytes))
            return None
        return topic, key, value

    def _reject(self, record: Record, reason: str) -> None:
        try:
            self._on_reject(record, reason)
        except Exception:
            log.exception("trainmon: dropped a %s record: %s", record.kind, reason)


def encode_safely(record: Record) -> tuple[Record, bytes]:
    """A record and its JSON, for any value a caller could put in it.

    pydantic takes anything into a free-form field (``RunRecord.config``, typed
    ``dict[str, Any]``) but cannot serialize ``torch.bfloat16``, a numpy array,
    ``object()`` or a dict that holds itself, and writes nesting deeper than consumers can
    parse. Free-form fields therefore always go through ``json_safe`` (odd values become
    text, anything JSON holds keeps its value), as does any other field that fails to
    serialize. The record returned is a copy when a field was changed."""
    free = _free_form_fields(type(record))
    if free:
        record = record.model_copy(update={name: json_safe(getattr(record, name)) for name in free
                                           if getattr(record, name) is not None})
    try:
        return record, encode(record)
    except Exception:
        pass
    fixed = {}
    for name in type(record).model_fields:
        try:
            record.model_dump_json(include={name})
        except Exception:
            fixed[name] = json_safe(getattr(record, name))
    safe = record.model_copy(update=fixed)
    return safe, encode(safe)


@lru_cache(maxsize=None)
def _free_form_fields(model: type[Record]) -> tuple[str, ...]:
    """Fields whose type lets any value in (``Any`` somewhere in the annotation)."""
    return tuple(name for name, field in model.model_fields.items()
                 if _mentions_any(field.annotation))


def _mentions_any(annotation) -> bool:
    return annotation is Any or any(_mentions_any(a) for a in typing.get_args(annotation))


def too_large(record: Record, size: int, limit: int) -> str:
    """Why a record cannot go to Kafka, naming its largest field."""
    sizes = {name: len(json.dumps(value, default=str)) for name, value in record.__dict__.items()}
    field = max(sizes, key=sizes.get)
    step = getattr(record, "step", None)
    return (f"{size:,} bytes of JSON{f' at step {step}' if step is not None else ''}, over the "
            f"{limit:,}-byte limit of one Kafka message; its largest field is {field!r} "
            f"(~{sizes[field]:,} bytes)")
