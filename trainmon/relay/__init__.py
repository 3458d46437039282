"""A node's relay: the ranks of one host send their records to one local process, which
packs them across ranks and sends them to Kafka (see :mod:`.server`). The ranks reach it
through :mod:`trainmon.kafka_client.relay_transport` when ``TRAINMON_RELAY`` names its
socket."""
