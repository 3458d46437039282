"""What a Kafka client's refusal means, said as the setting to check (kafka_client.settings):
librdkafka's own words, as it logs them, and a broker going away is not one of them."""

import pytest

from trainmon.kafka_client.settings import cause_of


@pytest.mark.parametrize("said, cause", [
    ("sasl_ssl://10.0.0.1:9093/bootstrap: SASL authentication error: Authentication failed during "
     "authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512 (after 313ms in state AUTH_REQ)",
     "refused the login"),
    ("10.0.0.1:9093/bootstrap: Disconnected: connection closed by peer: receive 0 after POLLIN "
     "(after 1ms in state APIVERSION_QUERY)", "wants TLS"),
    ("ssl://10.0.0.1:9093/bootstrap: Disconnected: SSL connection closed by peer (after 1ms in state UP)",
     "wants a login"),
    ("ssl://10.0.0.1:9093/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify "
     "failed: broker certificate could not be verified", "not trusted"),
    ("FindCoordinator response error: Group authorization failed.", "may not do it"),
])
def test_a_refusal_names_its_cause(said, cause):
    assert cause in cause_of(said)


@pytest.mark.parametrize("said", [
    # A broker killed or restarted: connections that were up for a while close. An outage.
    "127.0.0.1:47333/1: Disconnected: connection closed by peer: receive 0 after POLLIN (after 19997ms in state UP)",
    "ssl://10.0.0.1:9093/1: Disconnected: SSL connection closed by peer (after 20004ms in state UP)",
    "127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused (after 0ms in state CONNECT)",
    "1/1 brokers are down",
])
def test_an_outage_is_no_refusal(said):
    assert cause_of(said) is None


def test_topics_kafka_does_not_create_in_time_are_a_kafka_error_naming_them(monkeypatch):
    """The admin future's timeout is concurrent.futures' TimeoutError, not a
    KafkaException: it went out raw, past every caller's `except KafkaError`."""
    import concurrent.futures
    from types import SimpleNamespace

    from trainmon.kafka_client import admin
    from trainmon.kafka_client.errors import KafkaError

    class Unanswered:
        def result(self, timeout):
            raise concurrent.futures.TimeoutError()

    fake = SimpleNamespace(list_topics=lambda timeout: SimpleNamespace(topics={}),
                           create_topics=lambda new, operation_timeout: {t.topic: Unanswered() for t in new})
    monkeypatch.setattr(admin, "_admin", lambda env, bootstrap: fake)
    with pytest.raises(KafkaError, match=r"did not answer for t\.step within 2 s \(bootstrap h:1\)") as caught:
        admin.create_topics(["t.step"], bootstrap="h:1", timeout_s=2)
    assert caught.value.retriable
