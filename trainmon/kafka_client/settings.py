"""Client settings from ``TRAINMON_KAFKA_*`` env vars, spelt for each client library.

A job reaching a SASL / SSL cluster sets env vars only: TRAINMON_KAFKA_SECURITY_PROTOCOL,
_SASL_MECHANISM, _SASL_USERNAME, _SASL_PASSWORD, _SSL_CAFILE, _SSL_CERTFILE,
_SSL_KEYFILE, _SSL_PASSWORD.
"""

from __future__ import annotations

import logging
import os
import re
import time

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

# How a librdkafka producer picks a key's partition: Java's murmur2, which is kafka-python's
# (the fallback transport's) default and the Java client's. librdkafka's own default
# (consistent_random, a CRC32) would put a run's records sent through confluent-kafka on
# other partitions than the same run's records sent through kafka-python, and the alerts
# engines of a group would each see only part of the run (topics.record_key).
PARTITIONER = "murmur2_random"  # murmur2 of the key; a message without a key: any partition
# How a consumer group shares out partitions: "range" gives partition p of every topic to
# the same member (the topics have one partition count), so the member that reads a run's
# steps also reads its GPU, MoE, eval and run records (docs/alerts.md, "Scaling out").
# librdkafka's default "range,roundrobin" elects range too while every member offers it;
# naming it alone makes that a guarantee.
ASSIGNMENT_STRATEGY = "range"

# env var -> (librdkafka property, kafka-python argument)
_SECURITY = {
    "TRAINMON_KAFKA_SECURITY_PROTOCOL": ("security.protocol", "security_protocol"),
    "TRAINMON_KAFKA_SASL_MECHANISM": ("sasl.mechanism", "sasl_mechanism"),
    "TRAINMON_KAFKA_SASL_USERNAME": ("sasl.username", "sasl_plain_username"),
    "TRAINMON_KAFKA_SASL_PASSWORD": ("sasl.password", "sasl_plain_password"),
    "TRAINMON_KAFKA_SSL_CAFILE": ("ssl.ca.location", "ssl_cafile"),
    "TRAINMON_KAFKA_SSL_CERTFILE": ("ssl.certificate.location", "ssl_certfile"),
    "TRAINMON_KAFKA_SSL_KEYFILE": ("ssl.key.location", "ssl_keyfile"),
    "TRAINMON_KAFKA_SSL_PASSWORD": ("ssl.key.password", "ssl_password"),
}


def bootstrap_servers(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("TRAINMON_KAFKA_BOOTSTRAP", DEFAULT_BOOTSTRAP)


def security_from(env: dict) -> dict:
    """The TRAINMON_KAFKA_* security settings present in env (by env var name)."""
    return {var: env[var] for var in _SECURITY if env.get(var)}


def librdkafka(env: dict | None = None, bootstrap: str | None = None) -> dict:
    """confluent-kafka's configuration: bootstrap servers, security, logging."""
    env = os.environ if env is None else env
    config = {
        "bootstrap.servers": bootstrap or bootstrap_servers(env),
        # After a broker outage, reconnect within a second (not after a backoff grown large).
        "reconnect.backoff.max.ms": 1000,
        # librdkafka's own log: the critical, and errors that name why a client cannot
        # talk to Kafka at all (a wrong password, TLS, the wrong protocol: see ClientLog);
        # the rest (broker down ...) comes through error_cb, rate-limited: during an
        # outage it repeats every second.
        "log_level": 6,
        "logger": _CLIENT_LOG,
        "error_cb": _report_error,
    }
    config.update({rd: env[var] for var, (rd, _) in _SECURITY.items() if env.get(var)})
    return config


def kafka_python(env: dict | None = None, bootstrap: str | None = None) -> dict:
    """kafka-python's arguments (the producer's fallback transport)."""
    env = os.environ if env is None else env
    settings = {"bootstrap_servers": (bootstrap or bootstrap_servers(env)).split(",")}
    settings.update({kp: env[var] for var, (_, kp) in _SECURITY.items() if env.get(var)})
    return settings


_LOG = logging.getLogger("trainmon.kafka")
_last_said: dict[str, float] = {}


def _report_error(error) -> None:
    """librdkafka's client-level errors (broker down, all brokers down ...): each kind once
    a minute at WARNING. They are transient by nature -- the client keeps reconnecting --
    and during an outage they would otherwise arrive every second. One that names a
    cause a setting fixes is said as that (see cause_of)."""
    if _said_cause(error.str()):
        return
    key = error.name()
    now = time.monotonic()
    if now - _last_said.get(key, -1e9) >= 60:
        _last_said[key] = now
        _LOG.warning("Kafka: %s", error.str())


# librdkafka's words for why a client cannot talk to Kafka at all, and what to check. A
# client that meets one keeps trying (and the producer keeps the records, as during an
# outage): a setting, not time, fixes it, so it is said as an error naming the setting.
_CAUSES = [
    (r"SASL authentication error", "Kafka refused the login: the user or password is wrong "
     "(TRAINMON_KAFKA_SASL_USERNAME, TRAINMON_KAFKA_SASL_PASSWORD)"),
    (r"certificate verify failed", "Kafka's TLS certificate is not trusted: TRAINMON_KAFKA_SSL_CAFILE "
     "must name the CA file of the stack (`trainmon up` printed it)"),
    (r"SSL handshake failed", "TLS with Kafka failed: check TRAINMON_KAFKA_SSL_CAFILE and "
     "TRAINMON_KAFKA_SECURITY_PROTOCOL"),
    (r"incorrect security\.protocol", "Kafka's listener wants TLS: set TRAINMON_KAFKA_SECURITY_PROTOCOL "
     "(SASL_SSL for a `trainmon up --listen` stack)"),
    # Plain text to a TLS listener: the broker drops the connection at its first request.
    # (Only then: a connection up for a while and closed is a broker going away.)
    (r"connection closed by peer: receive 0 after POLLIN \(after \d+ms in state APIVERSION_QUERY\)",
     "Kafka closed the connection at its first request: its listener wants TLS "
     "(TRAINMON_KAFKA_SECURITY_PROTOCOL=SASL_SSL for a `trainmon up --listen` stack)"),
    # TLS without a SASL login to a SASL_SSL listener: closed within a second of opening.
    (r"SSL connection closed by peer \(after \d{1,3}ms in state UP\)", "Kafka closed the TLS "
     "connection at once: it wants a login (TRAINMON_KAFKA_SECURITY_PROTOCOL=SASL_SSL, "
     "TRAINMON_KAFKA_SASL_MECHANISM, _SASL_USERNAME, _SASL_PASSWORD)"),
    (r"uthorization failed", "Kafka refused the request: this user may not do it (a training job's "
     "writer may only produce to the record topics; consumers need the reader or admin)"),
]
_CAUSE_PATTERNS = [(re.compile(words), cause) for words, cause in _CAUSES]


def cause_of(text: str) -> str | None:
    """What to check, where ``text`` (a librdkafka error or log line) names a setting's fault."""
    for words, cause in _CAUSE_PATTERNS:
        if words.search(text):
            return cause
    return None


def _said_cause(text: str) -> bool:
    """Say a cause once a minute, as an error; True when ``text`` named one."""
    cause = cause_of(text)
    if cause is None:
        return False
    now = time.monotonic()
    if now - _last_said.get(cause, -1e9) >= 60:
        _last_said[cause] = now
        _LOG.error("trainmon: %s. Kafka said: %s", cause, text)
    return True


class ClientLog:
    """librdkafka's log (its ``logger``): a line naming a cause is said as that; else
    only critical lines pass (its errors repeat at every reconnect)."""

    def log(self, level: int, fmt: str, *args) -> None:
        text = fmt % args if args else fmt
        if not _said_cause(text) and level >= logging.CRITICAL:
            _LOG.log(level, "%s", text)


_CLIENT_LOG = ClientLog()
