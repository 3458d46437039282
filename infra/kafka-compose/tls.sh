#!/bin/sh
# The kafka-tls service: once, a CA and the brokers' TLS key and certificate, into the
# volume kafka-tls (/etc/kafka/secrets in the brokers):
#   ca.pem      the CA certificate: the one file a training job needs
#   broker.p12  the brokers' key and certificate chain (PKCS#12, KAFKA_TLS_PASSWORD)
#   ca.p12      the CA's key (it never leaves the volume)
# One certificate serves the three brokers: they differ by port, not by name. Its names:
# PUBLIC_HOST (a DNS name or an IP address), localhost, and the brokers' service names.
# Kept once made; `docker compose down -v` (or removing the volume) makes new ones, and the
# nodes then need the new ca.pem. A site CA instead: put ca.pem and broker.p12 in the volume.
set -eu
cd /etc/kafka/secrets
if [ -f broker.p12 ]; then
    echo "kafka-tls: keeping the CA and broker certificate made before"
    exit 0
fi
case "$PUBLIC_HOST" in
    *:*) public="ip:$PUBLIC_HOST" ;;        # IPv6
    *[!0-9.]*) public="dns:$PUBLIC_HOST" ;;
    *) public="ip:$PUBLIC_HOST" ;;          # IPv4
esac
pass="$TLS_PASSWORD"
keytool -genkeypair -keystore ca.p12 -storetype PKCS12 -storepass "$pass" -alias ca \
    -dname "CN=trainmon compose CA" -keyalg EC -groupname secp256r1 -validity 3650 -ext bc:c
keytool -exportcert -keystore ca.p12 -storepass "$pass" -alias ca -rfc -file ca.pem
keytool -genkeypair -keystore broker.p12 -storetype PKCS12 -storepass "$pass" -alias broker \
    -dname "CN=$PUBLIC_HOST" -keyalg EC -groupname secp256r1 -validity 825
keytool -certreq -keystore broker.p12 -storepass "$pass" -alias broker -file broker.csr
keytool -gencert -keystore ca.p12 -storepass "$pass" -alias ca -infile broker.csr \
    -outfile broker.crt -rfc -validity 825 -ext eku=serverAuth \
    -ext "SAN=$public,dns:localhost,dns:kafka,dns:kafka-2,dns:kafka-3"
# The signed certificate goes in with its chain: the CA first, then the reply.
keytool -importcert -keystore broker.p12 -storepass "$pass" -alias ca -file ca.pem -noprompt
keytool -importcert -keystore broker.p12 -storepass "$pass" -alias broker -file broker.crt
rm -f broker.csr broker.crt
chmod 600 ca.p12 broker.p12
chmod 644 ca.pem
echo "kafka-tls: made ca.pem and broker.p12 for $PUBLIC_HOST"
