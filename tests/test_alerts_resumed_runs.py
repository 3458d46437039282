"""Rules on runs resumed from an earlier checkpoint under the same run id (no loss spike,
divergence or step-time spike for retracing the curve; a warning burst after the restart
still fires) and on a routine warning printed slowly (no burst). In memory; each test
once failed."""

from __future__ import annotations

import math

from .alerts_support import engine_with, firing, run_engine, synthetic_run

T0 = 1.7e9


def _falling_loss(s, r, step, gpu, moe):
    """A pre-training loss curve: 11 -> ~3, falling fast early on; evals a little above."""
    step["loss"] = 3.0 + 8.0 * math.exp(-s / 150) + 0.01 * math.sin(1.7 * s)
    step["eval_loss"] = step["loss"] + 0.05


def _resumed_from_earlier_checkpoint(crash_at: int, resume_from: int, mutate=_falling_loss,
                                     mutate_after=None, **kw):
    """A job killed (kill -9, a lost node: no run end) after step ``crash_at - 1``, requeued
    and resumed (a new run start, same run id) from its checkpoint at ``resume_from``
    (``mutate_after``: the resumed part's mutation, if other than ``mutate``)."""
    before = synthetic_run("resumed", t0=T0, ranks=2, steps=crash_at, end=False, mutate=mutate, **kw)
    after = synthetic_run("resumed", t0=T0 + crash_at + 120, ranks=2, steps=crash_at + 300,
                          mutate=mutate_after or mutate, **kw)
    after = [r for r in after if r.kind == "run" or r.step >= resume_from]
    return before + after


def test_resume_from_an_earlier_checkpoint_is_no_loss_spike_or_divergence():
    """The loss at the checkpoint is higher than where the killed job got to: the resumed
    run retraces steps 200-400 at the losses it had then. That is not a spike, not a
    divergence, and its eval at step 200 is no eval spike."""
    records = _resumed_from_earlier_checkpoint(400, 200, eval_every=50)
    fired = firing(run_engine(engine_with(), records))
    assert [(a.rule, a.step) for a in fired] == []


def test_resume_from_a_checkpoint_a_little_back_is_no_loss_divergence():
    records = _resumed_from_earlier_checkpoint(600, 400)
    fired = firing(run_engine(engine_with(), records))
    assert [(a.rule, a.step) for a in fired] == []


def test_resumed_runs_first_slow_steps_are_its_warm_up_not_an_iteration_time_spike():
    """A resumed process compiles and warms up again: its first steps are slow, like a
    fresh run's (which iteration_time_spike leaves alone for min_samples steps)."""
    def slow_first_steps_after_resume(s, r, step, gpu, moe):
        if 200 <= s < 205:
            step["duration_ms"] *= 6

    records = _resumed_from_earlier_checkpoint(260, 200, mutate=None,
                                               mutate_after=slow_first_steps_after_resume)
    fired = firing(run_engine(engine_with(), records))
    assert [(a.rule, a.step) for a in fired] == []


_SIGNATURE = "NCCL WARN NET/IB : Got completion from peer # with status=# opcode=#"


def _nccl_warnings(count: int, step: int) -> dict:
    return dict(level="warning", source="nccl", count=count, first_step=step, last_step=step,
                signature=_SIGNATURE, text="NCCL WARN NET/IB : Got completion from peer 10.0.0.7<49152> "
                                           "with status=12 opcode=0 len=0 vendor err 129 (Recv)")


def _routine_warning(count: int, step: int) -> dict:
    return dict(_nccl_warnings(count, step), first_step=0,
                signature="NCCL WARN NET/IB : # : Got async event : port active",
                text="NCCL WARN NET/IB : mlx5_0:1 Got async event : port active")


def _every_five_minutes(dt: float):
    """The routine warning once every 5 minutes, sent as the aggregator does (counts 1, 2,
    4, ...): 2 lines in any 10 minutes, against nccl_warning_burst's limit of 10."""
    every = round(300 / dt)

    def mutate(s, r, step, gpu, moe):
        n = s // every + 1  # lines printed so far (one at steps 0, every, 2 x every, ...)
        if s % every == 0 and n & (n - 1) == 0:
            gpu["log_events"] = [_routine_warning(n, s)]
    return mutate


def test_a_burst_of_nccl_warnings_after_the_job_was_restarted_fires():
    """log_event counts are "so far" of the process that printed them. A job (a step every
    10 s) printed the routine warning 64 times over 5 hours, was killed and requeued (same
    run id, resumed from its checkpoint); the new process counts from 1 again and prints
    a warning 16 times within seconds: a burst, as in a fresh run. Judged against the old
    process's 64, none of the new counts 1..16 was a new line, and it stayed silent."""
    def burst(s, r, step, gpu, moe):
        if 2000 <= s <= 2004:
            gpu["log_events"] = [_routine_warning(2 ** (s - 2000), s)]

    def later_part(records):
        return [r for r in records if r.kind == "run" or getattr(r, "step", None) is None or r.step >= 1990]

    before = synthetic_run("nccl", t0=T0, steps=2000, dt=10.0, end=False, mutate=_every_five_minutes(10.0))
    after = later_part(synthetic_run("nccl", t0=T0 + 200, steps=2020, dt=10.0, mutate=burst))
    fresh = later_part(synthetic_run("fresh", t0=T0 + 200, steps=2020, dt=10.0, mutate=burst))
    def bursts(records):  # (the synthetic loss flattens out: loss_plateau, info, is right)
        return [a.step for a in firing(run_engine(engine_with(), records)) if a.rule == "nccl_warning_burst"]

    assert bursts(fresh) == [2004]
    assert [r.count for r in before if r.kind == "log_event"] == [1, 2, 4, 8, 16, 32, 64]
    # (before the resume: the routine warning alone, the next test's case)
    assert [step for step in bursts(before + after) if step >= 1990] == [2004]


def test_a_routine_warning_printed_every_five_minutes_is_no_burst():
    """The routine `port active` warning a healthy job prints now and then, once every 5
    minutes for 3 hours. The log_event record at count 32 brings 16 lines that were printed
    over the last 80 minutes, not within `window_s`: it fired as a burst of 16."""
    records = synthetic_run("routine", t0=T0, steps=3 * 360, dt=10.0, mutate=_every_five_minutes(10.0))
    assert [r.count for r in records if r.kind == "log_event"] == [1, 2, 4, 8, 16, 32]
    assert firing(run_engine(engine_with(), records)) == []


def test_an_earlier_warning_record_sent_again_is_no_restart():
    """Records come at least once: the count-16 record sent again after the count-32 one
    (older, with its own time) is not a new process counting from 1 again, whose 16 lines
    would be a burst."""
    records = synthetic_run("resent", t0=T0, steps=3 * 360, dt=10.0, mutate=_every_five_minutes(10.0),
                            end=False)
    events = [r for r in records if r.kind == "log_event"]
    assert [e.count for e in events] == [1, 2, 4, 8, 16, 32]
    assert firing(run_engine(engine_with(), records + [events[-2]])) == []
