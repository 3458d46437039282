"""Edge cases of the rules with logic of their own (rules/): odd but valid records, and
healthy runs the rules must tolerate. Each test here failed on the code before its fix."""

from __future__ import annotations

from datetime import datetime, timezone

from trainmon.schemas import StepRecord

from .alerts_support import engine_with, firing

UTC = timezone.utc
T0 = 1.7e9


def step_record(step: int, run_id: str = "edge", rank: int = 0, world_size: int = 1, **fields) -> StepRecord:
    fields.setdefault("loss", 2.0 + 0.01 * (step % 5))  # (not frozen)
    return StepRecord(run_id=run_id, rank=rank, world_size=world_size, host="node0",
                      time=datetime.fromtimestamp(T0 + step, UTC), event_id=f"{run_id}-{rank}-{step}",
                      step=step, **fields)


def process(engine, records) -> list:
    return [a for r in records for a in engine.process(r)]


def test_grad_norm_beyond_clip_after_zero_norms_fires_instead_of_crashing():
    """A rank whose earlier norms were all 0 (no gradient yet: frozen layers, dead
    gradients) has an own median of 0; a norm 10,000x the assumed clip after them is
    bad, and the message must not divide by that median."""
    engine = engine_with()
    records = [step_record(s, norm=0.0) for s in range(20, 25)] + [step_record(25, norm=1e4)]
    fired = firing(process(engine, records))
    assert [(a.rule, a.step) for a in fired if a.rule == "grad_norm_beyond_clip"] == [("grad_norm_beyond_clip", 25)]


def test_iteration_time_spike_takes_a_batch_size_schedule_for_no_spike():
    """A batch-size schedule that quadruples the global batch makes each step some 4x
    slower for the rest of the run: healthy, not an iteration-time spike (and, its slow
    steps kept out of the baseline, one that would stay open to the end of the run)."""
    engine = engine_with()
    records = [step_record(s, duration_ms=1000.0 * (1 if s < 100 else 4) * (1 + 0.01 * (s % 3)),
                           global_batch_size=256 if s < 100 else 1024) for s in range(200)]
    assert [a.rule for a in firing(process(engine, records))] == []


def test_iteration_time_spike_still_fires_at_an_unchanged_batch_size():
    engine = engine_with()
    records = [step_record(s, duration_ms=1000.0 * (1 if s < 100 else 4), global_batch_size=256)
               for s in range(110)]
    fired = firing(process(engine, records))
    assert [(a.rule, a.step) for a in fired] == [("iteration_time_spike", 102)]
