#!/bin/sh
# A broker is healthy when it answers an authenticated API-versions request on its
# INTERNAL listener (the one the consumers and the other brokers use).
set -eu
. /trainmon/admin-client.sh
exec /opt/kafka/bin/kafka-broker-api-versions.sh --bootstrap-server localhost:19092 \
    --command-config "$ADMIN_CONFIG" > /dev/null 2>&1
