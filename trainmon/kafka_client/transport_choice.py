"""Which transport the producer uses: the node's relay where one is named, else confluent-kafka
unless told or unable."""

from __future__ import annotations

import logging
import os

from .transport import Transport, TransportSettings, Undelivered

log = logging.getLogger("trainmon.producer")

CONFLUENT, KAFKA_PYTHON = "confluent-kafka", "kafka-python"


def choose_client(env: dict | None = None) -> str:
    """confluent-kafka unless ``TRAINMON_KAFKA_CLIENT=kafka-python`` or it is not installed."""
    env = os.environ if env is None else env
    wanted = (env.get("TRAINMON_KAFKA_CLIENT") or CONFLUENT).strip().lower()
    if wanted == KAFKA_PYTHON:
        return KAFKA_PYTHON
    if wanted != CONFLUENT:  # a typo must not pass for a choice; the job still logs
        log.warning("trainmon: TRAINMON_KAFKA_CLIENT=%r is neither %s nor %s; using %s",
                    env.get("TRAINMON_KAFKA_CLIENT"), CONFLUENT, KAFKA_PYTHON, CONFLUENT)
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        log.info("trainmon: confluent-kafka is not installed; sending with kafka-python")
        return KAFKA_PYTHON
    return CONFLUENT


def make_transport(client: str, config: TransportSettings, on_undelivered: Undelivered,
                   relay: str | None = None) -> Transport:
    """The client's transport to Kafka; the node's relay's (its socket path) where given."""
    if relay:
        from .relay_transport import RelayTransport

        return RelayTransport(relay, config, on_undelivered)
    if client == KAFKA_PYTHON:
        from .kafka_python_transport import KafkaPythonTransport

        return KafkaPythonTransport(config, on_undelivered)
    from .confluent_transport import ConfluentTransport

    return ConfluentTransport(config, on_undelivered)
