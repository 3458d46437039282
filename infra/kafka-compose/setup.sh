#!/bin/sh
# The kafka-setup service, once the three brokers are healthy (again at every `up`: each
# step is idempotent): the SCRAM users of the EXTERNAL listener and their ACLs, the same
# as `trainmon up --listen` grants (trainmon/kafka_client/acls.py):
#   writer  (training jobs)      write + describe the record topics, idempotent produce; nothing else
#   reader  (consumers elsewhere) read + describe the record topics, any consumer group; write
#                                 only its dead letters (${TOPIC_PREFIX}deadletter)
# admin is the brokers' own login and the only super user (the compose consumers use it).
# With StandardAuthorizer and allow.everyone.if.no.acl.found=false, nobody else may
# describe, read or write anything.
set -eu
. /trainmon/admin-client.sh
kafka="--bootstrap-server kafka:19092,kafka-2:19092,kafka-3:19092 --command-config $ADMIN_CONFIG"
bin=/opt/kafka/bin
for user in writer reader; do
    if [ "$user" = writer ]; then password="$WRITER_PASSWORD"; else password="$READER_PASSWORD"; fi
    $bin/kafka-configs.sh $kafka --alter --entity-type users --entity-name "$user" \
        --add-config "SCRAM-SHA-512=[iterations=8192,password=$password]"
done
topics="--topic $TOPIC_PREFIX --resource-pattern-type prefixed"
$bin/kafka-acls.sh $kafka --add --allow-principal User:writer --operation Write --operation Describe $topics
$bin/kafka-acls.sh $kafka --add --allow-principal User:writer --operation IdempotentWrite --cluster
$bin/kafka-acls.sh $kafka --add --allow-principal User:reader --operation Read --operation Describe $topics
$bin/kafka-acls.sh $kafka --add --allow-principal User:reader --operation Read --operation Describe --group '*'
$bin/kafka-acls.sh $kafka --add --allow-principal User:reader --operation Write --topic "${TOPIC_PREFIX}deadletter"
echo "kafka-setup: users writer and reader, and their ACLs on ${TOPIC_PREFIX}*"
