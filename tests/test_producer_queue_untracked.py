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


def _queued_items(worker: Worker) -> list[tuple]:
    items = []
    while worker.queued:
        items.append(worker._items.get_nowait())
    return items


def test_a_queued_log_call_holds_one_object_that_counts_towards_the_collectors_next_pass(tmp_path, monkeypatch):
    """Each object a waiting record holds counts towards the collector's next young pass
    (every 700 net allocations), which some log call then pays for: the names are a tuple
    shared by every call of them and the values items of the record's own tuple, so one."""
    monkeypatch.setattr(Worker, "_start", lambda self: None)
    producer = Producer(ProducerConfig(bootstrap="127.0.0.1:9", run_id="one-object",
                                       spill_dir=tmp_path / "spill"))
    gc.disable()
    try:
        gc.collect()
        before = gc.get_count()[0]
        for step in range(1000):
            producer.log_step(step, epoch=0.0, step_tokens=4096, duration_ms=250.0, loss=2.0, norm=1.0, lr=3e-4)
        assert gc.get_count()[0] - before < 1100  # (three a call, names and values apart: ~3,000)
    finally:
        gc.enable()
        producer._worker._closed = True


def test_names_that_change_every_call_do_not_keep_a_loops_steady_names_from_being_shared(tmp_path, monkeypatch):
    monkeypatch.setattr(Worker, "_start", lambda self: None)
    producer = Producer(ProducerConfig(bootstrap="127.0.0.1:9", run_id="churn", spill_dir=tmp_path / "spill"))
    try:
        for step in range(3000):  # a timer named anew at every step: more sets than are kept
            producer.log_step(step, loss=2.0, timers={f"microbatch-{step}": 1.0})
        _queued_items(producer._worker)
        for step in range(3):
            producer.log_step(step, loss=2.0, timers={"forward": 1.0})
        names = [item[7] for item in _queued_items(producer._worker)]  # (topic, key, kind, ..., names, *values)
        assert names[0] == ("step", "loss", "timers\0forward") and names[0] is names[1] is names[2]
    finally:
        producer._worker._closed = True
