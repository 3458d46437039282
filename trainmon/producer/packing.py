"""Encoded records -> Kafka messages: each message packs a (topic, key)'s records as JSON
Lines, because a Kafka client spends more CPU per message than per record."""

from __future__ import annotations

from ..kafka_client.transport import Entry
from ..schemas import MAX_MESSAGE_BYTES, MAX_RECORDS_PER_MESSAGE, pack


def pack_messages(entries: list[Entry]) -> list[Entry]:
    """Encoded records -> Kafka messages: the records of each (topic, key) packed in
    order, up to MAX_RECORDS_PER_MESSAGE and MAX_MESSAGE_BYTES per message."""
    if len(entries) == 1:
        return entries  # (the common case at training rates: one record, as it is)
    by_key: dict[tuple[str, bytes], list[bytes]] = {}
    for topic, key, value in entries:
        by_key.setdefault((topic, key), []).append(value)
    messages: list[Entry] = []
    for (topic, key), values in by_key.items():
        start, size = 0, 0
        for i, value in enumerate(values):
            if i > start and (i - start >= MAX_RECORDS_PER_MESSAGE
                              or size + len(value) > MAX_MESSAGE_BYTES):
                messages.append((topic, key, pack(values[start:i])))
                start, size = i, 0
            size += len(value) + 1
        messages.append((topic, key, pack(values[start:])))
    return messages
