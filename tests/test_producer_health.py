"""The producer's own health as producer_health records, in memory (a MemoryBroker stands
in for Kafka and can be taken away): while delivering they say nothing waits; during an
outage they say what waits in the spill file and for how long nothing reached Kafka, and
arrive once it is back; a run shorter than the interval sends none."""

from __future__ import annotations


from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.producer import Producer, ProducerConfig
from trainmon.schemas import ProducerHealthRecord, decode, unpack

from .waiting import wait_until

HEALTH = "trainmon.producer_health"


def health_records(broker: MemoryBroker) -> list[ProducerHealthRecord]:
    return [decode("producer_health", r) for value in broker.values(HEALTH) for r in unpack(value)]


def producer_for(broker: MemoryBroker, tmp_path, **config) -> Producer:
    return Producer(ProducerConfig(run_id="health", spill_dir=tmp_path / "spill", **config),
                    transport=broker.transport)


def test_health_records_tell_an_outage_afterwards_and_the_recovery(tmp_path):
    broker = MemoryBroker()
    producer = producer_for(broker, tmp_path, health_interval_s=0.1)
    for step in range(20):
        producer.log_step(step, loss=1.0)
    assert producer.flush(10)
    healthy = wait_until(lambda: [h for h in health_records(broker) if h.sent >= 20], 10,
                         "a health record after the first 20 steps")[0]
    assert (healthy.step, healthy.spilled, healthy.held_in_memory, healthy.dropped) == (19, 0, 0, 0)
    assert healthy.spill_error is None and 0 <= healthy.last_sent_age_s < 5

    broker.up = False
    for step in range(20, 50):
        producer.log_step(step, loss=1.0)
    wait_until(lambda: producer.spilled >= 30, 10, "the outage's steps in the spill file")
    seen_during = len(health_records(broker))
    producer.report_health()  # (the thread does too; this one is sure to see the spill)
    broker.up = True
    assert producer.flush(10)

    after = health_records(broker)[seen_during:]  # they waited in the spill file too
    outage = [h for h in after if h.spilled >= 30]
    assert outage, [(h.step, h.spilled) for h in after]
    assert all(h.step == 49 and h.dropped == 0 for h in outage)
    # Nothing reached Kafka from the outage's start: the age grows through it.
    assert max(h.last_sent_age_s for h in outage) >= 0.5
    recovered = wait_until(lambda: [h for h in health_records(broker) if h.spilled == 0 and h.sent >= 50],
                           10, "a health record after the recovery")[-1]
    assert recovered.step == 49 and recovered.last_sent_age_s < 5
    assert producer.close(10)
    assert health_records(broker)[-1].step == 49  # the last word, at close


def test_a_run_shorter_than_the_interval_sends_no_health_record(tmp_path):
    broker = MemoryBroker()
    producer = producer_for(broker, tmp_path)  # the default interval: 60 s
    assert producer.config.health_interval_s == 60
    for step in range(5):
        producer.log_step(step, loss=1.0)
    assert producer.close(10)
    assert broker.values(HEALTH) == [] and len(broker.values("trainmon.step")) >= 1


def test_the_interval_comes_from_the_environment_and_0_turns_it_off(tmp_path):
    config = ProducerConfig.from_env({"TRAINMON_PRODUCER_HEALTH_INTERVAL_S": "0"}, spill_dir=tmp_path)
    assert config.health_interval_s == 0
    broker = MemoryBroker()
    producer = Producer(config, transport=broker.transport)
    assert producer._health is None
    producer.close(5)
    assert ProducerConfig.from_env({}).health_interval_s == 60
