"""RecordStream over packed messages: a poll's record budget holds, whatever the packing."""

import uuid
from datetime import datetime, timezone

from trainmon import topics
from trainmon.consumers.stream import RecordStream
from trainmon.schemas import MAX_RECORDS_PER_MESSAGE, StepRecord, encode, pack

from .conftest import send_raw


def steps(first: int, n: int) -> list[bytes]:
    return [encode(StepRecord(run_id="rs", rank=0, world_size=1, host="h",
                              time=datetime.now(timezone.utc), event_id=f"rs-{i}", step=i, epoch=0,
                              step_tokens=1, duration_ms=1, loss=1, norm=1, lr=1))
            for i in range(first, first + n)]


def test_polls_keep_to_their_record_budget_over_packed_and_single_messages(
        kafka_broker, bootstrap, topic_prefix):
    topic = topics.topic_for("step", topic_prefix)
    kafka_broker.create_topics([topic])
    packed = steps(0, 6 * MAX_RECORDS_PER_MESSAGE)
    raw = [(topic, b"rs/0", pack(packed[i:i + MAX_RECORDS_PER_MESSAGE]), 0)
           for i in range(0, len(packed), MAX_RECORDS_PER_MESSAGE)]
    raw += [(topic, b"rs/0", value, 0) for value in steps(len(packed), 50)]  # then a trickle
    send_raw(bootstrap, raw)

    stream = RecordStream(f"rs-{uuid.uuid4().hex[:6]}", ["step"], topic_prefix=topic_prefix,
                          env={"TRAINMON_KAFKA_BOOTSTRAP": bootstrap})
    try:
        received, sizes = [], []
        while len(received) < len(packed) + 50:
            batch = stream.poll(timeout_ms=1000, max_records=1000)
            assert len(sizes) < 200, f"stuck after {len(received)} records: {sizes}"
            sizes.append(len(batch))
            received += batch
    finally:
        stream.close()
    assert [m.record.step for m in received] == list(range(len(packed) + 50))
    assert max(sizes) <= 1000, sizes
    # The trickle is not read two messages a poll: the budget follows the packing.
    assert len([s for s in sizes if s]) <= 6 * MAX_RECORDS_PER_MESSAGE // 1000 + 3, sizes
    assert {(m.offset, m.index) for m in received[:2]} == {(0, 0), (0, 1)}
