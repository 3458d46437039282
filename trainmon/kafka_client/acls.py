"""Kafka ACLs of a secured stack (see trainmon.stack_security): who may do what.

With StandardAuthorizer and ``allow.everyone.if.no.acl.found=false`` nothing is allowed
without an ACL, except to the super user (``admin``, the stack itself). These give:

- ``writer`` (training jobs): write and describe the topics under the stack's prefix,
  and the idempotent producer's cluster permission; nothing to read, no group;
- ``reader`` (consumers run elsewhere): read and describe those topics, and use any
  consumer group; write only its dead letters (``<prefix>deadletter``).
"""

from __future__ import annotations

from ..topics import DEADLETTER
from . import settings
from .errors import KafkaError


def grant_stack_acls(topic_prefix: str, *, env: dict, bootstrap: str, timeout_s: float = 30.0) -> None:
    from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, AdminClient,
                                       ResourcePatternType, ResourceType)

    def allow(user, resource, name, pattern, *operations):
        return [AclBinding(resource, name, pattern, f"User:{user}", "*", op, AclPermissionType.ALLOW)
                for op in operations]

    topics, prefixed = ResourceType.TOPIC, ResourcePatternType.PREFIXED
    literal = ResourcePatternType.LITERAL
    bindings = [
        *allow("writer", topics, topic_prefix, prefixed, AclOperation.WRITE, AclOperation.DESCRIBE),
        *allow("writer", ResourceType.BROKER, "kafka-cluster", literal, AclOperation.IDEMPOTENT_WRITE),
        *allow("reader", topics, topic_prefix, prefixed, AclOperation.READ, AclOperation.DESCRIBE),
        # A consumer elsewhere dead-letters what it cannot decode: refused, the dead letter
        # was lost and the record's offset committed all the same.
        *allow("reader", topics, f"{topic_prefix}{DEADLETTER}", literal, AclOperation.WRITE),
        *allow("reader", ResourceType.GROUP, "*", literal, AclOperation.READ, AclOperation.DESCRIBE),
    ]
    admin = AdminClient(settings.librdkafka(env, bootstrap))
    for binding, future in admin.create_acls(bindings, request_timeout=timeout_s).items():
        try:
            future.result(timeout_s)
        except Exception as exc:
            raise KafkaError(f"cannot create the ACL {binding}: {exc}") from exc
