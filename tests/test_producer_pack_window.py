"""While a training loop logs faster than one message per pack window, its records leave
once per window; a window ends early once it holds a full message, and for a flush."""

from __future__ import annotations

from trainmon.schemas import MAX_RECORDS_PER_MESSAGE

from .conftest import read_records


def test_a_full_message_and_a_flush_do_not_wait_out_the_window(make_producer, bootstrap, topic_prefix):
    producer = make_producer(linger_ms=0, pack_window_ms=600_000)  # a ten-minute window
    producer.log_step(0, loss=1.0)  # after a quiet spell: leaves at once
    assert len(read_records(bootstrap, topic_prefix, "step", 1, timeout=30)) == 1
    burst = MAX_RECORDS_PER_MESSAGE + 100
    for step in range(1, burst + 1):
        producer.log_step(step, loss=1.0)
    # A full message's worth leaves long before the window is over ...
    assert len(read_records(bootstrap, topic_prefix, "step", 1 + MAX_RECORDS_PER_MESSAGE, timeout=60)) \
        >= 1 + MAX_RECORDS_PER_MESSAGE
    # ... and a flush sends the rest without waiting it out either.
    assert producer.flush(60)
    steps = sorted(r.step for r in read_records(bootstrap, topic_prefix, "step", 1 + burst, timeout=30))
    assert steps == list(range(burst + 1))
