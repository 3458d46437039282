"""In the default mode a log call never raises: a bad call is one rejected record, counted
and warned about once per kind, naming what was wrong. Strict mode still raises. In-memory:
the worker's queue is replaced by a list, nothing reaches Kafka."""

from __future__ import annotations

import logging
import math
import time
import typing

import pytest
from pydantic import BaseModel, ValidationError

import trainmon.producer as tm
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.producer import Producer, ProducerConfig
from trainmon.producer.deferred import DeferredRecord
from trainmon.producer.logger import MAX_REASON_CHARS
from trainmon.schemas import RECORD_TYPES, decode, unpack
from trainmon.topics import topic_for

INT64_MAX = 2**63 - 1
STEP = dict(epoch=0.5, step_tokens=4096, duration_ms=120.0, loss=2.0, norm=1.0, lr=1e-4)
ENVELOPE = {"host": "elsewhere", "rank": 3, "run_id": "other", "world_size": 8,
            "time": "2026-01-01T00:00:00Z", "event_id": "mine", "schema_version": 1}


@pytest.fixture
def make(tmp_path):
    made = []

    def make(**overrides):
        settings = dict(run_id="never-raises", spill_dir=tmp_path / "spill")
        settings.update(overrides)
        # In memory: what the training thread sees never depends on the transport.
        producer = Producer(ProducerConfig(**settings), transport=MemoryBroker().transport)
        producer.sent = []
        # A record of plain numbers is queued unbuilt (the sender thread builds it): built
        # here, as the sender thread would.
        producer._worker.submit = lambda topic, key, record: producer.sent.append(
            DeferredRecord.from_queued(record).build() if type(record) is tuple else record)
        made.append(producer)
        return producer

    yield make
    for producer in made:
        producer.close(timeout=1)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainmon.producer"]


@pytest.mark.parametrize("name", sorted(ENVELOPE))
def test_an_envelope_field_passed_to_a_log_call_is_rejected_by_name(make, caplog, name):
    producer = make()
    with caplog.at_level(logging.WARNING, logger="trainmon.producer"):
        assert producer.log_step(1, **STEP, **{name: ENVELOPE[name]}) is False
        assert producer.log_eval(1, loss=1.0, **{name: ENVELOPE[name]}) is False
        assert producer.run_end("failed", **{name: ENVELOPE[name]}) is False
    assert producer.rejected == {"step": 1, "eval": 1, "run": 1}
    assert producer.sent == []
    (first, *_) = warnings(caplog)
    assert name in first and "envelope" in first


def test_missing_and_malformed_arguments_are_rejected_not_raised(make, caplog):
    producer = make()
    with caplog.at_level(logging.WARNING, logger="trainmon.producer"):
        assert producer.log_step(5) is False                    # no loss
        assert producer.log_step(loss=1.0) is False             # no step
        assert producer.log_step() is False
        assert producer.log_step(1, 2.0) is False               # loss given positionally
        assert producer.log_step(1, step=2, loss=1.0) is False  # step given twice
        assert producer.log_step(1, loss="two") is False
        assert producer.log_eval() is False
        assert producer.log_moe_stats(1, aux_loss=0.1) is False
        assert producer.log_gpu_state() is False
        assert producer.log_allocator(1) is False
        assert producer.log_dataset() is False
        assert producer.log_gpu_model(sm_count=1) is False
        assert producer.run_start({}, "positional", "extra") is False
        assert producer.run_end("finished") is False            # not a status
    assert producer.rejected == {"step": 6, "eval": 1, "moe": 1, "gpu": 1, "allocator": 1,
                                 "dataset": 1, "gpu_model": 1, "run": 2}
    said = warnings(caplog)
    assert len(said) == 8  # once per kind
    step_warning = said[0]
    assert "loss" in step_warning and "Field required" in step_warning
    assert producer.sent == []
    # ... and the producer keeps working
    assert producer.log_step(6, loss=1.5) is True
    assert [r.step for r in producer.sent] == [6]


def test_module_level_calls_never_raise_either(make, monkeypatch):
    producer = make()
    monkeypatch.setattr(tm, "_default", producer)
    assert tm.log_step() is False
    assert tm.log_step(1, 2, 3) is False
    assert tm.log_step(1, loss=1.0, host="x") is False
    assert tm.log_eval(1) is False
    assert tm.run_end("failed", reason="NCCL watchdog timeout") is True
    assert producer.sent[-1].reason == "NCCL watchdog timeout"


def test_a_non_finite_duration_or_epoch_is_data_and_keeps_the_loss(make):
    producer = make()
    assert producer.log_step(1, loss=2.5, duration_ms=math.nan, epoch=math.inf, step_tokens=10)
    assert producer.log_step(2, loss=2.4, duration_ms=math.inf, epoch=math.nan)
    assert producer.log_eval(2, loss=2.0, duration_ms=math.nan, epoch=-math.inf, eval_tokens=10)
    first, second, evaluation = producer.sent
    assert first.loss == 2.5 and math.isnan(first.duration_ms) and first.epoch == math.inf
    assert first.tokens_per_second is None  # no rate from a NaN duration
    assert second.duration_ms == math.inf and math.isnan(second.epoch)
    assert math.isnan(evaluation.duration_ms) and evaluation.epoch == -math.inf
    assert producer.rejected == {}
    # a finite negative one is still wrong
    assert producer.log_step(3, loss=2.3, duration_ms=-1.0) is False
    assert producer.log_step(3, loss=2.3, epoch=-0.5) is False
    assert producer.rejected == {"step": 2}


@pytest.mark.parametrize("field", ["step", "step_tokens", "num_zeros", "consumed_samples",
                                   "num_params", "total_steps", "global_batch_size", "skipped"])
def test_integers_beyond_int64_are_refused_on_the_calling_thread(make, caplog, field):
    producer = make()
    fields = {**STEP, "step": 1}
    with caplog.at_level(logging.WARNING, logger="trainmon.producer"):
        assert producer.log_step(**{**fields, field: 2**70}) is False
        assert producer.log_step(**{**fields, field: INT64_MAX}) is True
    assert producer.rejected == {"step": 1}
    (said,) = warnings(caplog)
    assert field in said and "9223372036854775807" in said
    assert [getattr(r, field) for r in producer.sent] == [INT64_MAX]


def _int_fields(model: type[BaseModel], prefix: str = ""):
    """(path, model, field, annotation kind) for every int-carrying field, nested included."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        bare = [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a
                for a in (args or [annotation])]
        origin = typing.get_origin(annotation)
        if origin is list:
            item = bare[0]
            if isinstance(item, type) and issubclass(item, BaseModel):
                yield from _int_fields(item, f"{prefix}{name}.")
            elif item is int:
                yield f"{prefix}{name}", model, name, "list"
        elif int in bare and bool not in bare:
            yield f"{prefix}{name}", model, name, "scalar"


ENVELOPE_NAMES = {"run_id", "rank", "world_size", "host", "time", "event_id", "schema_version"}
INT_FIELDS = [(kind, path, model, name, how) for kind, record in RECORD_TYPES.items()
              for path, model, name, how in _int_fields(record) if name not in ENVELOPE_NAMES]


def _refuses(model, name: str, how: str, beyond: int, error: str) -> bool:
    value = [beyond] if how == "list" else beyond
    try:
        model.__pydantic_validator__.validate_assignment(model.model_construct(), name, value)
    except ValidationError as exc:
        return name in str(exc) and error in str(exc)
    return False


def test_every_int_field_of_every_record_is_bounded_to_int64():
    """ClickHouse stores them as Int64: a field added without a bound fails here."""
    paths = {f"{kind}.{path}" for kind, path, *_ in INT_FIELDS}
    assert {"step.step", "step.num_zeros", "allocator.stats.device", "gpu.temperature",
            "dataset.seed", "alert.ranks", "eval.eval_tokens"} <= paths
    unbounded = [f"{kind}.{path}" for kind, path, model, name, how in INT_FIELDS
                 if not (_refuses(model, name, how, 2**63, "less_than_equal")
                         and _refuses(model, name, how, -2**63 - 1, "greater_than_equal"))]
    assert unbounded == []


def test_a_run_id_over_the_limit_disables_the_producer_with_one_error(make, caplog):
    with caplog.at_level(logging.WARNING, logger="trainmon.producer"):
        producer = make(run_id="r" * 300)
        assert producer.log_step(1, loss=1.0) is False
        assert producer.log_step(2, loss=1.0) is False
        assert producer.run_end("failed") is False
    said = [r for r in caplog.records if r.name == "trainmon.producer"]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert "300" in said[0].getMessage() and "256" in said[0].getMessage()
    assert producer.sent == [] and producer.rejected == {"step": 2, "run": 1}
    assert producer.disabled_reason is not None


def test_run_end_carries_the_reason_cut_to_its_limit(make):
    producer = make()
    assert producer.run_end("failed", reason="CUDA out of memory")
    assert producer.run_end("failed", "RuntimeError: NCCL watchdog timeout")
    assert producer.run_end("failed", reason="x" * 10_000)
    short, positional, long = producer.sent
    assert short.reason == "CUDA out of memory" and short.status == "failed"
    assert positional.reason == "RuntimeError: NCCL watchdog timeout"
    assert len(long.reason) == MAX_REASON_CHARS and long.reason.endswith("...")


def test_strict_mode_still_raises(make):
    producer = make(strict=True)
    with pytest.raises(TypeError, match="host"):
        producer.log_step(1, loss=1.0, host="x")
    with pytest.raises(TypeError, match="loss"):
        producer.log_step(1)
    with pytest.raises(ValidationError, match="step"):
        producer.log_step(2**70, loss=1.0)
    with pytest.raises(TypeError):
        producer.log_step(1, 2.0)
    assert producer.log_step(1, loss=1.0, duration_ms=math.nan) is True
    with pytest.raises(ValueError, match="256"):
        make(strict=True, run_id="r" * 257)


def test_the_context_manager_ends_a_failed_run_with_the_exception_as_reason(make):
    producer = make()
    producer.close = lambda timeout=10.0: True  # keep the fixture's list of what was sent
    with pytest.raises(RuntimeError):
        with producer:
            producer.run_start()
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    start, end = producer.sent
    assert (end.event, end.status) == ("end", "failed")
    assert end.reason == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_an_error_at_every_tick_of_the_sender_neither_spins_nor_loses_records(tmp_path, caplog):
    """The sender thread's last resort: an error it did not expect, at every tick, is
    logged and tried again after a pause that doubles (not thousands of tracebacks a
    second on a core of the training node); once the error is gone, the records queued
    meanwhile reach Kafka."""
    from trainmon.producer import worker as worker_module

    from .waiting import wait_until

    broker = MemoryBroker()
    producer = Producer(ProducerConfig(run_id="sender-errors", spill_dir=tmp_path / "spill"),
                        transport=broker.transport)
    worker = producer._worker
    tick, failures = worker._tick, []

    def failing_tick():
        failures.append(time.monotonic())
        if len(failures) <= 6:
            raise RuntimeError("an error the sender did not expect")
        return tick()

    sleep, pauses = worker._sleep, []

    def recorded_sleep(seconds):
        pauses.append(seconds)
        return sleep(seconds)

    worker._tick, worker._sleep = failing_tick, recorded_sleep
    with caplog.at_level(logging.ERROR, logger="trainmon.producer"):
        for step in range(5):
            assert producer.log_step(step, **STEP)
        wait_until(lambda: len(failures) > 6, 10, "the sender thread's seventh tick")
        # The pauses the thread asked for double from the least; each was slept out (a
        # gap is never shorter than its pause). The gaps themselves are not compared with
        # each other: a loaded machine oversleeps a 10 ms pause by more than half.
        first = worker_module._ERROR_PAUSE_MIN_S
        assert pauses[:6] == [first * 2 ** n for n in range(6)], pauses
        gaps = [b - a for a, b in zip(failures, failures[1:7])]
        assert all(gap >= pause for gap, pause in zip(gaps, pauses)), (gaps, pauses)
        assert producer.flush(10)
    steps = [decode("step", line).step for value in broker.values(topic_for("step", producer.config.topic_prefix))
             for line in unpack(value)]
    assert steps == list(range(5))
    assert caplog.text.count("RuntimeError: an error the sender did not expect") == 6


def test_records_the_sender_had_taken_when_it_hit_an_error_are_kept_and_a_flush_is_answered(tmp_path):
    """An error mid-tick (a transport's flush raising, say) lost what the tick had taken
    from the queue: a record queued behind a flush was in no queue, file or flight, and
    the flush waited out its timeout. It is kept (and sent), the flush answered False."""
    import threading

    from .waiting import wait_until

    broker = MemoryBroker()
    producer = Producer(ProducerConfig(run_id="tick-error", spill_dir=tmp_path / "spill",
                                       health_interval_s=0), transport=broker.transport)
    assert producer.log_step(0, **STEP) and producer.flush(5)
    worker = producer._worker
    worker._callers_may_send = False  # (each log call queues its record)
    delivery, next_items = worker._delivery, worker._next_items
    flush, raised = delivery.flush, []
    entered, go = threading.Event(), threading.Event()

    def flush_once_raising(deadline):
        if not raised:
            raised.append(True)
            raise ValueError("filedescriptor out of range in select()")
        return flush(deadline)

    def gated():  # the thread's next tick waits here until the three items are queued
        worker._next_items = next_items
        entered.set()
        go.wait(10)
        return next_items()

    delivery.flush, worker._next_items = flush_once_raising, gated
    assert producer.log_step(10, **STEP)  # (ends the thread's current wait; its next tick is gated)
    assert entered.wait(10)
    assert producer.log_step(1, **STEP)
    answered = []
    flushing = threading.Thread(target=lambda: answered.append((producer.flush(5), time.monotonic())))
    flushing.start()
    wait_until(lambda: worker.queued == 2, 10, "the flush queued behind step 1")
    assert producer.log_step(2, **STEP)
    started = time.monotonic()
    go.set()  # one tick takes step 1, the flush and step 2
    flushing.join(10)
    [(ok, at)] = answered
    assert ok is False and at - started < 4  # answered at the error, not at its timeout
    wait_until(lambda: producer.flush(5), 20, "the kept records delivered")
    steps = {decode("step", line).step for value in broker.values(topic_for("step", producer.config.topic_prefix))
             for line in unpack(value)}
    assert steps == {0, 10, 1, 2}
    producer.close(timeout=2)
