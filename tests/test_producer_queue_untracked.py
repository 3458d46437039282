"""Records queued for the sender thread are left alone by Python's cyclic garbage
collector (see producer.deferred.queued): a producer logging flat out, 100,000 records
queued, spent a third of its CPU in the collector's full passes while they were objects
and dicts. No broker needed: the sender thread is kept from starting, so records stay
queued."""

import gc

from trainmon.producer import Producer, ProducerConfig
from trainmon.producer.worker import Worker


def test_queued_log_calls_add_no_objects_the_collector_tracks(tmp_path, monkeypatch):
    monkeypatch.setattr(Worker, "_start", lambda self: None)
    producer = Producer(ProducerConfig(bootstrap="127.0.0.1:9", run_id="untracked",
                                       spill_dir=tmp_path / "spill"))
    try:
        gc.collect()
        before = len(gc.get_objects())
        for step in range(5000):
            assert producer.log_step(step, epoch=0.0, step_tokens=4096, duration_ms=250.0, loss=2.0,
                                     norm=1.0, lr=3e-4, timers={"forward": 80.0, "backward": 160.0},
                                     losses={"lm": 1.5})
        assert producer._worker.queued == 5000
        # Two passes: the collector lets go of one level of nested tuples per pass.
        gc.collect()
        gc.collect()
        assert len(gc.get_objects()) - before < 100  # as objects and dicts: 20,000
    finally:
        producer._worker._closed = True  # (no thread to flush through)
