"""The pure engine (no Kafka): incident lifecycle (cooldown, rate limit, deterministic
ids), the NCCL RAS style rank summary, and robustness to odd but valid records."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

from trainmon.consumers.alerts import AlertEngine, load_config
from trainmon.consumers.alerts.incidents import event_id
from trainmon.schemas import RunRecord, encode

from .alerts_support import engine_with, failed_run_alerts, firing, process_records, run_engine, synthetic_run


def nan_steps(*steps):
    def mutate(s, r, step, gpu, moe):
        if s in steps:
            step["loss"] = float("nan")
    return mutate


def test_cooldown_holds_back_a_second_incident_of_the_same_kind():
    t0 = time.time() - 900
    records = synthetic_run("c", t0=t0, steps=40, mutate=nan_steps(10, 20, 35), end=False)
    cooled = process_records(AlertEngine(load_config(env={"TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "20"})), records)
    # One step per second. NaN at 10 fires and resolves at 11; the NaN at 20 comes 9 s
    # later, within the 20 s cooldown; the one at 35 comes 24 s later and fires again.
    assert [(a.state, a.step) for a in cooled] == [("firing", 10), ("resolved", 11),
                                                  ("firing", 35), ("resolved", 36)]
    assert [a.incident_id for a in cooled] == ["c/non_finite/run#1"] * 2 + ["c/non_finite/run#2"] * 2
    no_cooldown = process_records(AlertEngine(load_config(env={"TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "0"})), records)
    assert [a.step for a in no_cooldown if a.state == "firing"] == [10, 20, 35]


def test_rate_limit_caps_new_incidents_per_run():
    env = {"TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "0", "TRAINMON_ALERT_RATE_LIMIT_PER_MINUTE": "2"}
    engine = AlertEngine(load_config(env=env))
    records = synthetic_run("rl", t0=time.time() - 900, steps=40, mutate=nan_steps(*range(0, 40, 2)), end=False)
    firing = [a for a in process_records(engine, records) if a.state == "firing"]
    # 40 s of record time: two per rolling minute.
    assert len(firing) == 2
    assert engine.book.suppressed > 0


def test_ids_are_deterministic_and_event_ids_fit_the_schema():
    records = synthetic_run("a-very-long-run-id-" * 12, t0=1.7e9, steps=20, mutate=nan_steps(5), end=False)
    first = process_records(AlertEngine(load_config(env={})), records)
    again = process_records(AlertEngine(load_config(env={})), records)
    assert [a.event_id for a in first] == [a.event_id for a in again]
    assert first[0].event_id == event_id(first[0].incident_id, "firing")
    assert all(len(a.event_id) <= 128 for a in first)


def test_engine_never_fails_on_odd_but_valid_records():
    def odd(s, r, step, gpu, moe):
        step.update(loss=float("inf"), norm=float("-inf"), duration_ms=0.0, lr=-1.0, num_params=0,
                    loss_scale=0.0, total_steps=0)
        gpu.update(temp_slowdown=0, temperature=-40, throttle=",,,")
        moe.update(aux_loss=float("nan"), load_imbalance=1.0)
    engine = AlertEngine(load_config(env={}))
    process_records(engine, synthetic_run("odd", t0=1.7e9, ranks=3, steps=30, mutate=odd))
    engine.tick(time.time())
    assert engine.runs == {}  # the run ended and was forgotten


def test_mismatch_message_reads_like_nccl_ras():
    engine = AlertEngine(load_config(env={}))
    t0 = 1.7e9
    records = synthetic_run("ras", t0=t0, ranks=16, steps=1235, first_step=1100,
                            stop_rank_at={3: 1233, 7: 1233}, end=False)
    process_records(engine, records)
    assert engine.tick() == []  # record time alone: rank 3 and 7 are 1 s behind, grace 60 s
    (alert,) = engine.tick(now=t0 + 1236 + 65)  # a minute later on the wall clock, nothing new
    assert alert.rule == "rank_mismatch" and alert.ranks == [3, 7] and alert.step == 1233
    assert "14 ranks at step 1234, 2 ranks at step 1233 (ranks 3, 7)" in alert.message
    assert engine.tick(now=t0 + 1236 + 70) == []  # still open: not again


def test_mismatch_still_fires_when_the_lagging_rank_is_read_after_a_tick():
    """Rank 3's steps reach the engine only after the others' (another partition, read
    later) and after a tick: the step times it is behind must still be known then."""
    engine = AlertEngine(load_config(env={"TRAINMON_ALERT_RANK_MISMATCH_GRACE_S": "10"}))
    t0 = 1.7e9
    records = synthetic_run("late", t0=t0, ranks=8, steps=61, stop_rank_at={3: 40}, end=False)
    rank3_steps = [r for r in records if r.rank == 3 and r.kind != "run"]
    assert process_records(engine, [r for r in records if r not in rank3_steps]) == []
    assert engine.tick() == []  # 7 ranks, all at step 60
    process_records(engine, rank3_steps)
    (alert,) = engine.tick()  # by record time: rank 3 silent since step 41, 20 s ago
    assert alert.rule == "rank_mismatch" and alert.ranks == [3] and alert.step == 40


# -- lifecycle of the new rule families -----------------------------------------------------

def test_a_failed_run_stays_failed_until_it_starts_again():
    from .alerts_support import engine_with, firing, run_engine, synthetic_run

    engine = engine_with()
    records = synthetic_run("oom", t0=1.7e9, ranks=2, steps=30, end_status="failed",
                            end_reason="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    alerts = run_engine(engine, records, tick_after_s=3600)
    (fired,) = alerts  # no resolution at the run's end, and no stall after it
    assert (fired.rule, fired.state, fired.severity, fired.step, fired.ranks) == (
        "run_failed", "firing", "critical", 29, [0])
    assert engine.book.keys[("run_failed", "oom", "run")].open.ranks == {0, 1}  # rank 1 joined it
    assert "run oom failed after step 29: rank 0 (node0): torch.OutOfMemoryError: CUDA out of memory" \
        in fired.message
    assert [a.rule for a in engine.book.open_incidents("oom")] == ["run_failed"]
    # Restarted (a new start after the failure): the failure resolves.
    again = synthetic_run("oom", t0=1.7e9 + 100, ranks=2, steps=3, end=False)
    resolved = run_engine(engine, again)
    assert [(a.rule, a.state) for a in resolved] == [("run_failed", "resolved")]
    assert "the run started again" in resolved[0].message or "records again" in resolved[0].message
    cancelled = synthetic_run("cancel", t0=1.7e9, steps=5, end_status="aborted", end_reason="Slurm job cancelled")
    assert [(a.rule, a.severity) for a in firing(run_engine(engine_with(), cancelled))] == [
        ("run_failed", "warning")]


def test_fp16_warm_up_is_info_and_a_later_overflow_cascade_critical():
    """Megatron's fp16 calibration skips every iteration of its first log intervals (the
    scale falls from 2**32): info. Per-step DeepSpeed overflows later ("OVERFLOW! Skipping
    step. Attempted loss scale: 64, reducing to 32" on steps in a row): critical, and the
    scale falling 8x within 100 iterations is a collapse."""
    from .alerts_support import engine_with, firing, run_engine, synthetic_run

    def fp16(s, r, step, gpu, moe):
        if s < 8:  # calibration: every iteration skipped, no loss, the scale halving
            step.update(loss=None, norm=None, skipped=1, loss_scale=2.0 ** (32 - 2 * s))
        else:
            step.update(skipped=0, loss_scale=64.0)
        if 378 <= s <= 382:  # the cascade: attempted 64 -> 32 -> ... -> 2, step skipped
            step.update(loss=None, norm=None, skipped=1, loss_scale=2.0 ** (5 - (s - 378)))
    alerts = firing(run_engine(engine_with(), synthetic_run("fp16", t0=1.7e9, steps=400, mutate=fp16)))
    assert sorted((a.step, a.rule, a.severity) for a in alerts) == [
        (2, "skipped_iterations", "info"),
        (380, "loss_scale_collapse", "critical"),  # 8 is 8x below 64
        (380, "skipped_iterations", "critical"),
    ], [a.message for a in alerts]
    skipped = [a for a in alerts if a.rule == "skipped_iterations"]
    assert "calibrating" in skipped[0].message and "overflows" in skipped[1].message


def test_a_failure_is_judged_once_every_partition_is_read_and_names_every_failed_rank():
    """Kafka hands the run topic and the step topic over in any order: a run end read before
    the rank's last steps must not say "before its first step". The engine applies ends on
    its tick (which the service runs once every partition is read), so the alert has the
    last step, and all failures the tick sees, the first (usually the cause) first."""
    from .alerts_support import engine_with, synthetic_run

    run = synthetic_run("nccl", t0=1.7e9, ranks=8, steps=20, end_status="failed",
                        end_reason="NCCL watchdog timeout: ALLREDUCE ran for 600034 ms")
    run_topic = [r for r in run if r.kind == "run"]
    ends = run_topic[8:]
    ends[4] = ends[4].model_copy(update={"reason": "FileNotFoundError: doc_idx.npy",
                                         "time": ends[4].time - timedelta(seconds=1)})
    run_topic = run_topic[:8] + [ends[4]] + ends[:4] + ends[5:]
    engine = engine_with()
    out = []
    for record in run_topic + [r for r in run if r.kind != "run"]:  # the run topic read first
        out.extend(engine.process(record))
    out.extend(engine.tick())
    (fired,) = [a for a in out if a.state == "firing"]
    assert fired.rule == "run_failed" and fired.step == 19 and fired.ranks == list(range(8))
    assert fired.message == ("run nccl failed after step 19: rank 4 (node0): FileNotFoundError: doc_idx.npy; "
                             "ranks 0-3, 5-7: NCCL watchdog timeout: ALLREDUCE ran for 600034 ms")


def test_the_service_reads_eval_records():
    from trainmon.consumers.alerts.engine import INPUT_KINDS

    assert "eval" in INPUT_KINDS


def test_several_eval_sets_are_judged_each_on_its_own():
    """HF Trainer with two eval sets logs eval_a_loss and eval_b_loss at each eval step:
    1.2 and 2.5, alternating. Neither is a spike of the other."""
    from trainmon.schemas import EvalRecord

    from .alerts_support import engine_with, run_engine, synthetic_run

    records = [r for r in synthetic_run("sets", t0=1.7e9, steps=60, end=False)]
    evals = []
    for i, r in enumerate(records):
        if r.kind == "step" and r.step % 10 == 0 and r.step:
            for n, loss in enumerate((1.2, 2.5)):
                evals.append((i, EvalRecord(run_id="sets", rank=0, world_size=1, host="node0", time=r.time,
                                            event_id=f"e{r.step}-{n}", step=r.step, loss=loss - r.step / 1000)))
    for i, e in reversed(evals):
        records.insert(i + 1, e)
    assert run_engine(engine_with(), records) == []


def test_every_rule_state_survives_a_json_checkpoint():
    """Each rule's own state goes through the checkpoint as JSON and comes back the same:
    an engine restored halfway through a run decides the rest like one that never stopped."""
    import json

    from .alerts_support import engine_with, synthetic_run

    def busy(s, r, step, gpu, moe):
        step.update(loss_scale=2.0 ** 14, skipped=int(s in (40, 41)), nan_iterations=0,
                    global_batch_size=64, tflops_per_gpu=100.0 + s % 3)
        if s >= 45:
            step["norm"] = 30.0 + s  # exploding from 45 on
    records = synthetic_run("ckpt", t0=1.7e9, ranks=3, steps=80, mutate=busy, eval_every=5)
    half = len(records) // 2
    a, b = engine_with(), engine_with()
    for r in records[:half]:
        a.process(r)
        a.tick()
    state = json.loads(json.dumps(a.dump()))
    b.load(state)
    assert json.loads(json.dumps(b.dump())) == state
    rest_a, rest_b = [], []
    for r in records[half:]:
        rest_a += a.process(r) + a.tick()
        rest_b += b.process(r) + b.tick()
    assert [x.model_dump() for x in rest_a] == [x.model_dump() for x in rest_b]
    assert {x.rule for x in rest_a} >= {"exploding_grad"}


T0 = 1.7e9


def _loss_spike_at(steps):
    def mutate(s, r, step, *_):
        if s in steps:
            step["loss"] = 10.0
    return mutate


def test_a_run_resumed_from_an_earlier_checkpoint_fires_again_below_the_old_closed_step():
    """A run fails at step 99 after a loss spike at 60 that resolved; it is restarted (run
    start, same run id) from its step-50 checkpoint and spikes again at step 60. The second
    spike is a new incident, not "a late record from before the incident resolved"."""
    engine = engine_with()
    first = synthetic_run("r", t0=T0, steps=100, mutate=_loss_spike_at({60, 61}),
                          end_status="failed", end_reason="boom")
    before = firing(run_engine(engine, first))
    assert ("loss_spike", 60) in [(a.rule, a.step) for a in before]
    restart = RunRecord(run_id="r", rank=0, world_size=1, host="node0", event="start",
                        time=datetime.fromtimestamp(T0 + 1000, timezone.utc), event_id="start-2")
    second = synthetic_run("r", t0=T0 + 1000, first_step=50, steps=100,
                           mutate=_loss_spike_at({60, 61}))
    after = firing(run_engine(engine, [restart, *second]))
    assert ("loss_spike", 60) in [(a.rule, a.step) for a in after], \
        [(a.rule, a.step, a.incident_id) for a in after]


def test_a_run_whose_steps_start_over_without_a_run_end_fires_again_below_the_old_closed_step():
    """The same without run records: the job was requeued (kill -9, no run end) and
    resumed from step 50; its steps go back (RunState.rewind) and the spike comes again."""
    engine = engine_with()
    first = synthetic_run("r", t0=T0, steps=100, mutate=_loss_spike_at({60, 61}), end=False)
    assert ("loss_spike", 60) in [(a.rule, a.step) for a in firing(run_engine(engine, first))]
    second = synthetic_run("r", t0=T0 + 1000, first_step=50, steps=100,
                           mutate=_loss_spike_at({60, 61}), end=False)
    after = firing(run_engine(engine, second))
    assert ("loss_spike", 60) in [(a.rule, a.step) for a in after]


def test_a_run_that_fails_while_the_rate_limit_is_spent_still_pages_its_failure():
    """40 GPUs overheat (40 per-GPU incidents: 30 fire, the rate limit of 30 a minute holds
    back the rest), then the job dies of it within the same minute. The run's failure is
    judged once, when its ends are applied: held back then, it never fires at all, and
    nobody is told the run failed."""
    def hot(s, r, step, gpu, moe):
        if s >= 5:
            gpu["temperature"] = 95
    records = synthetic_run("r", t0=T0, ranks=40, steps=20, mutate=hot, end_status="failed",
                            end_reason="Xid 79: GPU has fallen off the bus")
    engine = engine_with()
    fired = firing(run_engine(engine, records))
    assert engine.book.suppressed > 0  # the rate limit did hold the GPU incidents back
    assert "run_failed" in {a.rule for a in fired}


def test_a_failed_run_of_thousands_of_ranks_makes_an_alert_kafka_can_take():
    """Kafka takes a message of up to 1,000,000 bytes (the producer's message.max.bytes,
    kafka_client.transport). The run_failed alert lists every distinct reason: 8,192 ranks
    with their own watchdog lines make an alert of ~1.8 MB, which the durable producer
    refuses at once, every time (see the Kafka test below)."""
    [fired] = failed_run_alerts(8192)
    assert fired.state == "firing"
    assert len(encode(fired)) < 1_000_000, f"{len(encode(fired)):,} bytes"


def test_the_publishers_memory_of_sent_alerts_keeps_the_recent_ones_only():
    """What stops the publisher sending an alert twice is bounded: the engine makes an
    alert again only while replaying its last minute or so, and a set of every id ever
    published grew for as long as the service ran."""
    from trainmon.consumers.alerts.alert_topic import RecentIds

    ids = RecentIds(size=3)
    for one in ("a", "b", "c"):
        ids.add(one)
    ids.add("a")  # seen again: the most recent now
    ids.add("d")  # "b" is the oldest: dropped
    assert [e in ids for e in "abcd"] == [True, False, True, True]
    assert len(ids) == 3
    many = RecentIds()
    for n in range(250_000):
        many.add(f"run/rule/rank{n}#1/firing")
    assert len(many) == 100_000 and "run/rule/rank249999#1/firing" in many


# -- judging a silent rank while the service is behind ------------------------------------


def _gpu_ahead(run_id: str, ranks: int, t: float) -> list:
    """A GPU record per rank at record time ``t``: another topic's partition read ahead."""
    from trainmon.schemas import GpuRecord

    return [GpuRecord(run_id=run_id, rank=r, world_size=ranks, host=f"node{r // 8}", event_id=f"ahead-{r}",
                      time=datetime.fromtimestamp(t, timezone.utc), step=0, id=r % 8, clock=1900, max_clock=1980,
                      power=600_000, power_limit=700_000, temperature=60, temp_slowdown=87, gpu_util=99,
                      mem_util=40, dram_free=2**30, pcie_rx=1, pcie_tx=1, fan=0, throttle="")
            for r in range(ranks)]


def test_a_silent_rank_fires_while_behind_on_the_step_records_alone():
    """tick_behind: rank 3 stopped at step 40 while the others reached step 60, one step a
    second, all on the step topic: proven on the steps' own clock, without the tick that
    waits for every partition to be read to its end."""
    engine = engine_with(rank_mismatch_grace_s=10)
    records = synthetic_run("behind", t0=T0, ranks=8, steps=61, stop_rank_at={3: 40}, end=False)
    assert firing(process_records(engine, records)) == []
    fired = firing(engine.tick_behind())
    assert [(a.rule, a.ranks, a.step) for a in fired] == [("rank_mismatch", [3], 40)]
    assert engine.tick_behind() == []  # open already: not again


def test_while_behind_evidence_counts_once_held_for_the_slack():
    """As on the full tick: what the engine received less than wall_clock_slack_s ago does
    not count yet, so the full tick right after cannot resolve what this one fired."""
    engine = engine_with(rank_mismatch_grace_s=10, wall_clock_slack_s=5)
    records = synthetic_run("slack", t0=T0, ranks=8, steps=61, stop_rank_at={3: 40}, end=False)
    received = time.time()
    for record in records:
        engine.process(record, received)
    assert engine.tick_behind(now=received + 1) == []
    assert [(a.rule, a.ranks) for a in firing(engine.tick_behind(now=received + 6))] == [("rank_mismatch", [3])]


def test_while_behind_another_topic_read_ahead_proves_no_silence():
    """The full tick on record time takes the run's latest record of any kind as now: a
    GPU partition read 300 s ahead of the step partition makes a rank one step behind (mid
    step) look silent for 300 s. tick_behind judges on the step records' clock instead."""
    ranks = 8
    records = synthetic_run("skew", t0=T0, ranks=ranks, steps=31, end=False)
    records = [r for r in records if not (r.kind == "step" and r.step == 30 and r.rank == 5)]  # mid step 30
    records = [r for r in records if r.kind in ("run", "step")] + _gpu_ahead("skew", ranks, T0 + 330)
    behind = engine_with(rank_mismatch_grace_s=10)
    process_records(behind, records)
    assert behind.tick_behind() == []
    full = engine_with(rank_mismatch_grace_s=10)
    process_records(full, records)
    assert [(a.rule, a.ranks) for a in firing(full.tick())] == [("rank_mismatch", [5])]  # why it waits


def test_while_behind_an_open_mismatch_is_not_resolved_on_a_standing_clock():
    """A hang (no step from any rank) opened on the wall clock stays open through ticks
    while behind: the step clock stands still, which is no evidence that rank 5 is back."""
    engine = engine_with(rank_mismatch_grace_s=3, wall_clock_slack_s=2)
    records = synthetic_run("hang", t0=T0, ranks=8, steps=31, stop_rank_at={5: 29}, end=False)
    process_records(engine, records)
    last = max(r.time.timestamp() for r in records)
    assert [(a.rule, a.ranks) for a in firing(engine.tick(now=last + 30))] == [("rank_mismatch", [5])]
    assert engine.tick_behind() == []
    assert [a.state for a in engine.book.open_incidents("hang")] == ["firing"]
