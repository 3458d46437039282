"""Clients that a secured stack must refuse, for test_cluster_hosts.py (run on a node).

    python -m tests.cluster_probe MODE SPILL_DIR      (the writer's env, from the stack)
    python -m tests.cluster_probe topic-ends STACK_DIR (on the stack's host: as its admin)

MODE: no-credentials (TLS, no SASL), wrong-password, plaintext (to the TLS listener),
no-ca (the stack's CA file not given), unknown-principal (a user the stack never made,
producing), writer-consumes (the writer's own login, reading). Prints one JSON line: the first error trainmon reported,
how long it took, and whether anything was delivered.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from trainmon.kafka_client import Consumer, KafkaError, settings
from trainmon.producer import Producer, ProducerConfig

REPORT_WITHIN_S = 10.0


def settings_for(mode: str) -> dict:
    env = settings.security_from(os.environ)
    if mode == "no-credentials":
        env["TRAINMON_KAFKA_SECURITY_PROTOCOL"] = "SSL"
        for var in ("TRAINMON_KAFKA_SASL_MECHANISM", "TRAINMON_KAFKA_SASL_USERNAME", "TRAINMON_KAFKA_SASL_PASSWORD"):
            env.pop(var, None)
    elif mode == "wrong-password":
        env["TRAINMON_KAFKA_SASL_PASSWORD"] = "not-the-password"
    elif mode == "plaintext":
        env = {"TRAINMON_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"}
    elif mode == "unknown-principal":
        env["TRAINMON_KAFKA_SASL_USERNAME"] = "mallory"
    elif mode == "no-ca":
        env.pop("TRAINMON_KAFKA_SSL_CAFILE")
    return env


class FirstError(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.message: str | None = None
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.message is None:
            self.message, self.at = record.getMessage(), time.monotonic()


def produce(mode: str, spill_dir: str) -> dict:
    errors = FirstError()
    logging.getLogger("trainmon").addHandler(errors)
    began = time.monotonic()
    producer = Producer(ProducerConfig(bootstrap=settings.bootstrap_servers(os.environ),
                                       run_id=f"probe-{mode}", spill_dir=spill_dir,
                                       kafka=settings_for(mode)))
    for step in range(5):
        assert producer.log_step(step, loss=1.0)
    while errors.message is None and time.monotonic() - began < REPORT_WITHIN_S:
        time.sleep(0.05)
    delivered = producer.flush(1.0)
    producer.close(1.0)
    return {"error": errors.message, "after_s": errors.at and errors.at - began, "delivered": delivered,
            "kept": producer.spilled}


def consume(spill_dir: str) -> dict:
    began = time.monotonic()
    consumer = Consumer("probe-writer", env=dict(os.environ))
    error = None
    try:
        consumer.subscribe(["trainmon.step"])
        while error is None and time.monotonic() - began < REPORT_WITHIN_S:
            try:
                messages = consumer.poll(0.5)
            except KafkaError as exc:
                error = str(exc)
            else:
                if messages:
                    return {"error": None, "read": len(messages)}
    finally:
        consumer.close()
    return {"error": error, "after_s": time.monotonic() - began, "read": 0}


def topic_ends(stack_dir: str) -> dict[str, int]:
    """Each topic's records in all (its partitions' end offsets added up), as the stack's admin."""
    from trainmon.kafka_client import TopicPartition
    from trainmon.stack import broker_of

    kafka = broker_of(Path(stack_dir))
    consumer = Consumer(env=kafka.client_env(), bootstrap=kafka.bootstrap)
    try:
        ends = {}
        for topic in sorted(consumer.topics()):
            partitions = [TopicPartition(topic, p) for p in consumer.partitions_for(topic)]
            ends[topic] = sum(consumer.end_offsets(partitions).values())
        return ends
    finally:
        consumer.close()


if __name__ == "__main__":
    mode, where = sys.argv[1], sys.argv[2]
    if mode == "topic-ends":
        print(json.dumps(topic_ends(where)), flush=True)
    else:
        print(json.dumps(consume(where) if mode == "writer-consumes" else produce(mode, where)), flush=True)
