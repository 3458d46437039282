"""Kafka client settings shared by the producer and the consumers, read from env.

Security settings pass straight through to kafka-python, so a job reaching a SASL / SSL
cluster sets env vars only: TRAINMON_KAFKA_SECURITY_PROTOCOL, _SASL_MECHANISM,
_SASL_USERNAME, _SASL_PASSWORD, _SSL_CAFILE, _SSL_CERTFILE, _SSL_KEYFILE.
"""

from __future__ import annotations

import os

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

_PASSTHROUGH = {
    "TRAINMON_KAFKA_SECURITY_PROTOCOL": "security_protocol",
    "TRAINMON_KAFKA_SASL_MECHANISM": "sasl_mechanism",
    "TRAINMON_KAFKA_SASL_USERNAME": "sasl_plain_username",
    "TRAINMON_KAFKA_SASL_PASSWORD": "sasl_plain_password",
    "TRAINMON_KAFKA_SSL_CAFILE": "ssl_cafile",
    "TRAINMON_KAFKA_SSL_CERTFILE": "ssl_certfile",
    "TRAINMON_KAFKA_SSL_KEYFILE": "ssl_keyfile",
    "TRAINMON_KAFKA_SSL_PASSWORD": "ssl_password",
}


def bootstrap_servers(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("TRAINMON_KAFKA_BOOTSTRAP", DEFAULT_BOOTSTRAP)


def client_settings(env: dict | None = None) -> dict:
    """bootstrap_servers plus any security settings present in env."""
    env = os.environ if env is None else env
    settings = {"bootstrap_servers": bootstrap_servers(env).split(",")}
    settings.update({key: env[var] for var, key in _PASSTHROUGH.items() if env.get(var)})
    return settings
