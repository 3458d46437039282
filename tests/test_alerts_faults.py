"""Known faults of the alert rules, each reproduced in memory (these tests failed on the
engine before they were fixed):

- ``stalled`` resolved itself after ``live_run_max_age_s`` while the job was still silent;
- ``iteration_time_spike`` took the slow steps into its median and resolved while the
  steps were still slow;
- an open incident hid a much larger escalation (a grad norm from 2e5 to 3e6 said nothing);
- ``exploding_grad`` fired on the first record of a run whose normal grad norm is 1e5 and
  never resolved;
- a bf16 run (Megatron prints ``loss scale: 1.0``) raised a critical ``loss_scale_collapse``
  on its first record, and Megatron's load-balancing loss (about 1.0 by construction) a
  ``moe_aux_loss``.
"""

from __future__ import annotations

from trainmon.consumers.alerts import AlertEngine, load_config

from .alerts_support import firing, run_engine, synthetic_run

T0 = 1.7e9


def test_stalled_stays_open_while_the_job_is_silent_past_live_run_max_age():
    engine = AlertEngine(load_config(env={}))
    records = synthetic_run("silent", t0=T0, ranks=2, steps=40, end=False)
    last = max(r.time.timestamp() for r in records)
    assert run_engine(engine, records) == []
    (fired,) = engine.tick(now=last + 600)  # 10 min of silence: limit max(300 s, 10 x 1 s)
    assert (fired.rule, fired.state, fired.step) == ("stalled", "firing", 39)
    # Past live_run_max_age_s (6 h) the engine forgets the run's windows: the job is still
    # silent, so the stall must stay open.
    assert engine.tick(now=last + 7 * 3600) == []
    assert engine.tick(now=last + 8 * 3600) == []
    assert [a.rule for a in engine.book.open_incidents("silent")] == ["stalled"]
    assert "no run end" in fired.message
    # The job reports again: the stall resolves.
    later = synthetic_run("silent", t0=last + 9 * 3600, ranks=2, steps=3, first_step=0, end=False)
    resolved = [a for a in run_engine(engine, [r for r in later if r.kind != "run"]) if a.rule == "stalled"]
    assert [a.state for a in resolved] == ["resolved"]
    assert engine.book.open_incidents("silent") == []


def test_iteration_time_spike_stays_open_while_the_steps_are_slow():
    def slow_stretch(s, r, step, gpu, moe):
        if 40 <= s < 100:
            step["duration_ms"] = 5000.0
    engine = AlertEngine(load_config(env={}))
    alerts = [a for a in run_engine(engine, synthetic_run("slow", t0=T0, steps=120, mutate=slow_stretch,
                                                          end=False))
              if a.rule == "iteration_time_spike"]
    assert [a.state for a in alerts] == ["firing", "resolved"], [a.message for a in alerts]
    fired, resolved = alerts
    assert 40 <= fired.step <= 42
    assert resolved.step >= 100, resolved.message  # not while steps 40-99 are still slow
    assert "of its last 40 records" in fired.message  # the median of the steps before


def test_an_escalation_notifies_again():
    """A grad norm at 2e5 fires; 3e6 on the next step is 15x worse: a new alert says so."""
    def explodes(s, r, step, gpu, moe):
        step["norm"] = 1e4 * (1 + 0.01 * (s % 7))
        if s == 40:
            step["norm"] = 2e5
        if s == 41:
            step["norm"] = 3e6
    engine = AlertEngine(load_config(env={}))
    alerts = run_engine(engine, synthetic_run("esc", t0=T0, steps=60, mutate=explodes, end=False))
    spikes = [(a.state, a.step, a.incident_id) for a in alerts if a.rule == "grad_spike"]
    assert spikes == [("firing", 40, "esc/grad_spike/run#1"), ("resolved", 41, "esc/grad_spike/run#1"),
                      ("firing", 41, "esc/grad_spike/run#2"), ("resolved", 42, "esc/grad_spike/run#2")]
    escalated = next(a for a in alerts if a.incident_id == "esc/grad_spike/run#2" and a.state == "firing")
    assert "escalated from 2e+05 at step 40" in escalated.message
    assert "superseded by #2" in next(a for a in alerts if a.incident_id == "esc/grad_spike/run#1"
                                      and a.state == "resolved").message


def test_exploding_grad_judges_a_run_by_its_own_scale():
    """A run whose normal grad norm is 1e5: nothing on its first records, nor ever while it
    stays there; a sustained 30x explosion fires, and resolves once the norm is back."""
    def scale_1e5(s, r, step, gpu, moe):
        step["norm"] = 1e5 * (1 + 0.05 * ((s * 7919) % 11 - 5) / 5)
    engine = AlertEngine(load_config(env={}))
    assert run_engine(engine, synthetic_run("big", t0=T0, steps=80, mutate=scale_1e5)) == []

    def explodes(s, r, step, gpu, moe):
        scale_1e5(s, r, step, gpu, moe)
        if 40 <= s < 50:
            step["norm"] *= 30 * (1 + 0.01 * (s - 40))
    alerts = [a for a in run_engine(AlertEngine(load_config(env={})),
                                    synthetic_run("big2", t0=T0, steps=80, mutate=explodes, end=False))
              if a.rule == "exploding_grad"]
    assert [(a.state, a.step) for a in alerts] == [("firing", 42), ("resolved", 50)]
    assert "the run's own scale" in alerts[0].message


def test_bf16_loss_scale_and_megatron_load_balancing_loss_are_healthy():
    def megatron_bf16_moe(s, r, step, gpu, moe):
        step["loss_scale"] = 1.0
        moe["aux_loss"] = 1.01 + 0.01 * ((s * 31) % 3)
    records = synthetic_run("bf16", t0=T0, steps=60, mutate=megatron_bf16_moe)
    assert firing(run_engine(AlertEngine(load_config(env={})), records)) == []
