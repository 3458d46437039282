# Sourced by healthcheck.sh and setup.sh: the admin's client settings for the INTERNAL
# listener (SASL/PLAIN, the login the brokers use with each other) in $ADMIN_CONFIG.
ADMIN_CONFIG=/tmp/trainmon-admin.properties
umask 077  # the file holds the admin password
cat > "$ADMIN_CONFIG" <<PROPERTIES
security.protocol=SASL_PLAINTEXT
sasl.mechanism=PLAIN
sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="admin" password="$ADMIN_PASSWORD";
PROPERTIES
