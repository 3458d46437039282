"""Producer -> real Kafka -> decoded records, for every record type."""

import math

import pytest

from trainmon import topics
from trainmon.producer.deferred import DeferredRecord
from trainmon.producer.packing import pack_messages
from trainmon.schemas import MAX_MESSAGE_BYTES, MAX_RECORDS_PER_MESSAGE, RECORD_TYPES, encode, unpack

from .conftest import read_records
from .samples import log_one_of_each

# Round trips and outages on both transports: librdkafka and the kafka-python fallback.
pytestmark = pytest.mark.usefixtures("both_clients")

LOGGED_KINDS = [k for k in RECORD_TYPES if k != "alert"]


def test_every_record_type_round_trips_with_nan_and_inf(make_producer, bootstrap, topic_prefix):
    sent = []
    producer = make_producer(run_id="rt", rank=1, world_size=2)
    original_submit = producer._worker.submit
    # (A record of plain numbers is queued unbuilt, for the sender thread to build: the
    # same record, as building it twice gives the same time and event id.)
    producer._worker.submit = lambda topic, key, record: (
        sent.append(DeferredRecord.from_queued(record).build() if type(record) is tuple else record),
        original_submit(topic, key, record))
    log_one_of_each(producer, step=7)
    assert producer.flush(20)

    by_kind = {}
    for record in sent:
        by_kind.setdefault(record.kind, []).append(record)
    assert set(by_kind) == set(LOGGED_KINDS)
    for kind, expected in by_kind.items():
        received = read_records(bootstrap, topic_prefix, kind, len(expected))
        # Byte-equal JSON is the exact comparison that also holds for NaN (NaN != NaN).
        assert [encode(r) for r in received] == [encode(r) for r in expected], kind
        assert all(r.run_id == "rt" and r.rank == 1 and r.world_size == 2 for r in received)

    step = read_records(bootstrap, topic_prefix, "step", 1)[0]
    assert math.isnan(step.loss) and step.norm == math.inf and step.params_norm == -math.inf


def test_alert_records_can_be_sent_prebuilt(make_producer, bootstrap, topic_prefix):
    from datetime import datetime, timezone

    from trainmon.schemas import AlertRecord

    alert = AlertRecord(run_id="rt", rank=3, world_size=8, host="engine",
                        time=datetime.now(timezone.utc), event_id="inc-1:firing", rule="nan_loss",
                        severity="critical", state="firing", incident_id="inc-1", ranks=[3],
                        step=40, value=math.nan, threshold=None, message="loss is NaN on rank 3")
    producer = make_producer()
    producer.send_record(alert)
    assert producer.flush(20)
    [received] = read_records(bootstrap, topic_prefix, "alert", 1)
    assert encode(received) == encode(alert)


def test_per_rank_order_is_kept(make_producer, bootstrap, topic_prefix):
    ranks, steps = 4, 300
    producers = [make_producer(run_id="order", rank=r, world_size=ranks) for r in range(ranks)]
    for step in range(steps):
        for p in producers:
            p.log_step(step, step_tokens=1024, duration_ms=10.0, loss=1.0, norm=1.0, lr=1e-4)
    assert all(p.flush(30) for p in producers)

    received = read_records(bootstrap, topic_prefix, "step", ranks * steps)
    assert len(received) == ranks * steps
    for r in range(ranks):
        assert [rec.step for rec in received if rec.rank == r] == list(range(steps))
    assert len({rec.event_id for rec in received}) == ranks * steps


def test_topic_per_kind_and_key_per_run(make_producer, bootstrap, topic_prefix):
    from .conftest import read_topic

    producer = make_producer(run_id="keys", rank=5, world_size=8)
    producer.log_eval(3, eval_tokens=10, duration_ms=1.0, loss=1.0)
    assert producer.flush(20)
    [message] = read_topic(bootstrap, topics.topic_for("eval", topic_prefix), 1)
    assert message.key == b"keys"  # every rank of a run: one partition, one alerts engine


def test_both_transports_put_a_run_on_the_same_partition(both_clients, make_producer, bootstrap,
                                                         topic_prefix):
    """This transport and the other one hash a run's key alike (murmur2), so ranks of one
    run that log through different transports still reach one partition, one engine."""
    from datetime import datetime, timezone

    from trainmon.schemas import StepRecord

    from .conftest import read_topic

    other = "kafka-python" if both_clients == "confluent-kafka" else "confluent-kafka"
    runs = [f"run-{i}" for i in range(16)]
    for rank, producer in enumerate([make_producer(), make_producer(client=other)]):
        for run in runs:
            producer.send_record(StepRecord(run_id=run, rank=rank, world_size=2, host="h", step=1, loss=1.0,
                                            time=datetime.now(timezone.utc), event_id=f"{run}-{rank}"))
        assert producer.flush(20), producer.config.client
    messages = read_topic(bootstrap, topics.topic_for("step", topic_prefix), 2 * len(runs))
    partitions: dict[bytes, set[int]] = {}
    for m in messages:
        partitions.setdefault(m.key, set()).add(m.partition)
    assert set(partitions) == {run.encode() for run in runs}
    assert all(len(p) == 1 for p in partitions.values()), partitions
    assert len(set().union(*partitions.values())) > 1  # the keys do spread over the partitions


def test_records_are_packed_per_topic_and_key_in_order_within_the_limits():
    entries = [("t.step", b"r/0", b"s%d" % i) for i in range(MAX_RECORDS_PER_MESSAGE + 10)]
    entries.insert(3, ("t.eval", b"r/0", b"e0"))
    entries.insert(7, ("t.step", b"r/1", b"other"))
    entries += [("t.gpu", b"r/0", b"x" * (MAX_MESSAGE_BYTES // 2))] * 3
    messages = pack_messages(entries)
    assert [(t, k, len(unpack(v))) for t, k, v in messages] == [
        ("t.step", b"r/0", MAX_RECORDS_PER_MESSAGE), ("t.step", b"r/0", 10), ("t.eval", b"r/0", 1),
        ("t.step", b"r/1", 1), ("t.gpu", b"r/0", 1), ("t.gpu", b"r/0", 1), ("t.gpu", b"r/0", 1)]
    assert [v for t, k, v in messages if (t, k) == ("t.step", b"r/0")] == [
        b"\n".join(b"s%d" % i for i in range(MAX_RECORDS_PER_MESSAGE)),
        b"\n".join(b"s%d" % i for i in range(MAX_RECORDS_PER_MESSAGE, MAX_RECORDS_PER_MESSAGE + 10))]
    assert all(len(v) <= MAX_MESSAGE_BYTES for _, _, v in messages)


def test_a_burst_travels_in_few_messages(make_producer, bootstrap, topic_prefix):
    from .conftest import read_topic

    producer = make_producer(run_id="burst", rank=0, world_size=1)
    for step in range(2000):
        producer.log_step(step, step_tokens=1024, duration_ms=10.0, loss=1.0, norm=1.0, lr=1e-4)
    assert producer.flush(30) and producer._worker.sent == 2000
    messages = read_topic(bootstrap, topics.topic_for("step", topic_prefix), 4)
    assert 4 <= len(messages) < 100
    assert sum(len(unpack(m.value)) for m in messages) == 2000
    received = read_records(bootstrap, topic_prefix, "step", 2000)
    assert [r.step for r in received] == list(range(2000))
