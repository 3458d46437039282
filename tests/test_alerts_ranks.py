"""Rank iteration mismatch with the alert service running live on the real broker."""

from __future__ import annotations

import random
import time

from .alerts_support import BackgroundService, engine_with, firing, send, service_env, synthetic_run, wait_for
from .conftest import read_records


def alerts_on_topic(bootstrap, prefix, expected, timeout):
    return read_records(bootstrap, prefix, "alert", expected, timeout=timeout)


def wait_for_ticks(bg: BackgroundService, ticks: int) -> None:
    """Until the service has judged silences ``ticks`` more times (it ticks every poll_s
    once caught up): a time to fire it had, however busy the machine."""
    target = bg.service.ticks + ticks
    wait_for(lambda: bg.service.ticks >= target, what=f"{ticks} more ticks", details=bg.describe)


def test_rank_that_stops_fires_one_mismatch_naming_it_and_resolves_when_it_catches_up(
        bootstrap, topic_prefix, make_producer, tmp_path):
    env = service_env(bootstrap, rank_mismatch_grace_s=10)
    producer = make_producer()
    # Record times from now on, one step per second: record time alone decides here.
    t0 = time.time()
    with BackgroundService(env, topic_prefix, tmp_path / "state") as bg:
        send(producer, synthetic_run("mm", t0=t0, ranks=8, steps=61, stop_rank_at={3: 40}, end=False))
        # Waiting on the service's own count keeps this process from churning Kafka clients.
        wait_for(lambda: bg.service.stats["alerts"] >= 1, what="the mismatch alert", details=bg.describe)
        wait_for_ticks(bg, 10)  # the service keeps judging (~2 s): it must not fire again
        # Rank 3 catches up: steps 41..60, later in record time than the others'.
        send(producer, synthetic_run("mm", t0=t0 + 20, ranks=8, steps=61, first_step=41, only_ranks={3},
                                     end=False))
        wait_for(lambda: bg.service.stats["alerts"] >= 2, what="the resolution", details=bg.describe)
        wait_for_ticks(bg, 5)  # and nothing after the resolution
    alerts = alerts_on_topic(bootstrap, topic_prefix, expected=2, timeout=30)
    assert [(a.rule, a.state) for a in alerts] == [("rank_mismatch", "firing"), ("rank_mismatch", "resolved")]
    firing, resolved = alerts
    assert firing.ranks == [3] and firing.step == 40
    # It fires as soon as the others' records prove rank 3 behind for 10 s, so where the
    # others are in that moment varies; rank 3 and its step do not.
    assert "1 rank at step 40 (rank 3)" in firing.message and "ranks at step" in firing.message
    assert firing.severity == "critical" and firing.threshold == 10
    assert firing.value > 10  # seconds behind
    assert resolved.incident_id == firing.incident_id and resolved.step == 60
    assert resolved.event_id != firing.event_id


def test_hang_one_step_behind_is_caught_on_the_wall_clock(bootstrap, topic_prefix, make_producer, tmp_path):
    """All ranks stop (the others wait in an all-reduce for rank 5): no record arrives any
    more, so only the wall clock can tell that rank 5 never reported step 30."""
    env = service_env(bootstrap, rank_mismatch_grace_s=3, wall_clock_slack_s=2)
    producer = make_producer()
    steps = 31
    t0 = time.time() - steps  # the run's last records are from about now
    with BackgroundService(env, topic_prefix, tmp_path / "state") as bg:
        send(producer, synthetic_run("hang", t0=t0, ranks=8, steps=steps, stop_rank_at={5: 29}, end=False))
        wait_for(lambda: bg.service.stats["alerts"] >= 1, what="the mismatch alert", details=bg.describe)
    alerts = alerts_on_topic(bootstrap, topic_prefix, expected=1, timeout=30)
    assert [(a.rule, a.state, a.ranks, a.step) for a in alerts] == [("rank_mismatch", "firing", [5], 29)]
    assert "7 ranks at step 30, 1 rank at step 29 (rank 5)" in alerts[0].message


# -- in memory: the cross-rank rules with many ranks ------------------------------------------

T0 = 1.7e9


def steps_of(run_id: str, ranks: int, steps: range, *, slow: dict[int, tuple[int, float]] | None = None,
             silent: dict[int, int] | None = None, jitter: dict[int, float] | None = None,
             only: set[int] | None = None, seed: int = 0) -> list:
    """Step records only (what the cross-rank rules read), every rank at 1 Hz of record
    time, step time 1000 ms +- 2 %. ``slow`` {rank: (from step, factor)}, ``silent``
    {rank: first step not logged}, ``jitter`` {rank: +- fraction} for a noisier rank,
    ``only``: just these ranks."""
    from datetime import datetime, timezone

    from trainmon.schemas import StepRecord

    rng = random.Random(seed)
    out = []
    for s in steps:
        t = datetime.fromtimestamp(T0 + s + 1, timezone.utc)
        for r in range(ranks):
            if (only is not None and r not in only) or s >= (silent or {}).get(r, s + 1):
                continue
            ms = 1000.0 * (1 + (jitter or {}).get(r, 0.02) * rng.uniform(-1, 1))
            first, factor = (slow or {}).get(r, (s + 1, 1.0))
            if s >= first:
                ms *= factor
            out.append(StepRecord(run_id=run_id, rank=r, world_size=ranks, host=f"node{r // 8}", time=t,
                                  event_id=f"{run_id}-{r}-{s}", step=s, duration_ms=ms,
                                  loss=2.0 + 0.01 * rng.random()))
    return out


def judged(engine, records) -> list[tuple]:
    """(alert, the step of the record whose processing emitted it), ticking on record time."""
    out = []
    for record in records:
        out += [(a, record.step) for a in engine.process(record) + engine.tick()]
    return out


def test_a_silent_rank_does_not_hold_the_straggler_verdicts_back():
    """Each step waits for every rank's time; a rank that went silent used to make every
    later step wait for it up to 256 steps, so a straggler after it fired 256 steps late
    (or, in a shorter run, never). A step now waits ``wait_s`` (30 s of record time) for
    its missing ranks, and those are not waited for again until they report."""
    engine = engine_with(rank_mismatch_grace_s=20)
    events = judged(engine, steps_of("quiet", 8, range(140), slow={5: (100, 1.5)}, silent={2: 10}))
    fired = [(a.rule, a.ranks, a.step, seen) for a, seen in events if a.state == "firing"]
    # The straggler's 5th slow step fires it as soon as the 7 ranks reporting have logged it.
    assert fired == [("rank_mismatch", [2], 9, 31), ("straggler", [5], 104, 104)]


def test_a_rank_whose_last_record_came_after_the_next_step_opened_is_not_waited_for_ever():
    """Rank 2's last step (9) arrives just after rank 0's step 10 (two senders a moment
    apart), then rank 2 is silent. It had reported "since step 10 was first reported", and
    every later step used to wait for it (up to 256 steps): the straggler never fired
    (benchmarks/scale.py --quick, once in three runs on a busy machine). A rank is waited
    for only while it keeps reporting: at the next look, a pass over the ranks later, it
    is given up on."""
    engine = engine_with(rank_mismatch_grace_s=20)
    records = steps_of("race", 8, range(140), slow={5: (100, 1.5)}, silent={2: 10})
    last = next(r for r in records if r.rank == 2 and r.step == 9)
    records.remove(last)
    records.insert(records.index(next(r for r in records if r.step == 10)) + 1, last)
    events = judged(engine, records)
    fired = [(a.rule, a.ranks, a.step, seen) for a, seen in events if a.state == "firing"]
    assert fired == [("rank_mismatch", [2], 9, 31), ("straggler", [5], 104, 104)]


def test_a_rank_read_late_is_still_waited_for():
    """A rank whose records come later than the others' (its partition read behind, its
    producer's batch still on the way) by less than wait_s is still compared with them."""
    engine = engine_with()
    others = set(range(8)) - {7}
    records = (steps_of("late", 8, range(20), only=others, slow={7: (5, 1.5)})
               + steps_of("late", 8, range(20), only={7}, slow={7: (5, 1.5)})
               + steps_of("late", 8, range(20, 30), slow={7: (5, 1.5)}))
    fired = [(a.rule, a.ranks, a.step) for a, _ in judged(engine, records) if a.state == "firing"]
    assert fired == [("straggler", [7], 9)]


def test_other_kinds_read_ahead_do_not_cut_the_straggler_wait_short():
    """GPU records read far ahead of the step topic (a warm-up replay reads topics one
    after the other) do not count as time passing for the steps waiting for their ranks:
    wait_s runs on step records' time."""
    from datetime import datetime, timezone

    from trainmon.schemas import GpuRecord

    engine = engine_with()
    records = steps_of("ahead", 8, range(20), slow={7: (5, 1.5)})
    first, rest = [r for r in records if r.rank != 7 or r.step < 5], [r for r in records if r.rank == 7 and r.step >= 5]
    gpu = [GpuRecord(run_id="ahead", rank=r, world_size=8, host="h", time=datetime.fromtimestamp(T0 + 600, timezone.utc),
                     event_id=f"g{r}", step=19, id=0, clock=1, max_clock=1, power=1, power_limit=1, temperature=1,
                     temp_slowdown=90, gpu_util=1, mem_util=1, dram_free=1, pcie_rx=1, pcie_tx=1, fan=0,
                     throttle="") for r in range(8)]
    events = judged(engine, gpu + first + rest)
    fired = [(a.rule, a.ranks, a.step) for a, _ in events if a.state == "firing" and a.rule == "straggler"]
    assert fired == [("straggler", [7], 9)]


def test_ranks_that_keep_reporting_behind_the_others_are_waited_for():
    """Half the ranks are read 40 s behind the other half (a partition read later, a
    producer running late), interleaved: more than wait_s, but they keep reporting, so each
    step still waits for them and a straggler among them is compared with all 8 ranks."""
    slow = {6: (50, 1.5)}
    ahead = steps_of("skew", 8, range(100), only={0, 1, 2, 3}, slow=slow)
    behind = steps_of("skew", 8, range(100), only={4, 5, 6, 7}, slow=slow)
    records = []
    for s in range(140):
        records += [r for r in ahead if r.step == s] + [r for r in behind if r.step == s - 40]
    events = judged(engine_with(), records)
    assert [(a.rule, a.ranks, a.step, seen) for a, seen in events if a.state == "firing"] == [
        ("straggler", [6], 54, 54)]
    assert "of 8 ranks at step 54" in events[0][0].message


def test_a_straggler_near_the_limit_fires_once_and_resolves_once():
    """Rank 3 runs 20 % slow, +- 6 % per step, against a limit of 1.15x: one step in six
    dips under the limit. With clear_after=1 and no hysteresis the incident resolved on
    such a step and fired again after the cooldown; now it stays open until the rank is
    back within clear_factor (halfway: 1.075x), and resolves at its first healthy step."""
    records = steps_of("near", 16, range(160), slow={3: (20, 1.2)}, jitter={3: 0.06}, seed=3)
    records = [r.model_copy(update={"duration_ms": r.duration_ms / 1.2}) if r.rank == 3 and r.step >= 150 else r
               for r in records]
    events = judged(engine_with(straggler_factor=1.15, straggler_cooldown_s=0), records)
    assert [(a.rule, a.state, a.ranks) for a, _ in events] == [("straggler", "firing", [3]),
                                                               ("straggler", "resolved", [3])]
    assert events[1][0].step == 150
    # Without the hysteresis (clearing at the firing limit) the same run flaps.
    flapping = judged(engine_with(straggler_factor=1.15, straggler_clear_factor=1.15, straggler_cooldown_s=0),
                      records)
    assert len(firing([a for a, _ in flapping])) > 3


def test_messages_about_1024_ranks_give_counts_and_the_ranks_that_stand_out():
    """Five nodes gone silent (40 ranks) and one straggler in a 1,024-rank run: one
    mismatch incident naming the first 12 silent ranks and counting the rest, the others
    one count however they are spread over the newest steps, and one straggler incident
    naming its rank; both messages short. (The straggler fires once the steps after the
    silence stop waiting for the silent ranks, 30 s on.)"""
    silent = {r: 20 for r in range(64, 104)}
    records = steps_of("big", 1024, range(60), slow={700: (25, 1.5)}, silent=silent)
    fired = firing([a for a, _ in judged(engine_with(rank_mismatch_grace_s=10), records)])
    assert [(a.rule, a.step) for a in fired] == [("rank_mismatch", 19), ("straggler", 29)]
    mismatch, straggler = fired
    assert mismatch.ranks == list(range(64, 104)) and straggler.ranks == [700]
    assert mismatch.message.startswith("rank iteration mismatch on run big: 984 ranks at steps 30-31, "
                                       "40 ranks at step 19 (ranks 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, "
                                       "74, 75, +28 more); behind for 11 s (grace 10 s)")
    assert "rank 700 (node87)" in straggler.message and "of 984 ranks at step 29" in straggler.message
    assert max(len(mismatch.message), len(straggler.message)) < 300


def test_straggler_state_survives_a_checkpoint():
    """Pending steps and the ranks given up on go into the engine's checkpoint and come
    back; a checkpoint written before wait_s (pending steps as a list) still loads."""
    import json

    from trainmon.consumers.alerts.rules.ranks import StragglerRule

    engine = engine_with(rank_mismatch_grace_s=20)
    records = steps_of("ckpt", 8, range(60), slow={5: (50, 1.5)}, silent={2: 10})
    cut = next(i for i, r in enumerate(records) if r.step == 52)
    first = judged(engine, records[:cut])
    restored = engine_with(rank_mismatch_grace_s=20)
    restored.load(json.loads(json.dumps(engine.dump())))
    rest = judged(restored, records[cut:])
    assert [(a.rule, a.ranks, a.step) for a in firing_events(first + rest)] == [
        ("rank_mismatch", [2], 9), ("straggler", [5], 54)]
    rule = StragglerRule("straggler", restored.config.rules.straggler, restored.book)
    old = rule.load_run_state([[7, [[0, 1000.0, T0 + 8], [1, 1010.0, T0 + 7.5]]]])
    assert old.steps == {7: {0: (1000.0, T0 + 8), 1: (1010.0, T0 + 7.5)}} and old.since == {7: T0 + 7.5}
    assert old.absent == set()


def firing_events(events: list[tuple]) -> list:
    return [a for a, _ in events if a.state == "firing"]


def test_a_service_that_stays_behind_still_names_a_silent_rank(tmp_path):
    """No partition read to its end (a saturated machine, a backlog that does not drain):
    the full tick never runs, and the silent rank is told from the step records alone, once
    the partitions replayed as warm-up are past. (No broker: the service is driven by hand.)"""
    from trainmon.consumers.stream import Message

    from .alerts_support import make_service

    # (No slack: the evidence counts as soon as it is read; the slack is the full tick's.)
    env = service_env("127.0.0.1:9", rank_mismatch_grace_s=10, wall_clock_slack_s=0)
    service = make_service(env, "tbehind.", tmp_path)
    service._caught_up = lambda: False  # (the runtime's view of the partitions' ends)
    records = synthetic_run("behind", t0=time.time() - 120, ranks=8, steps=61, stop_rank_at={3: 40}, end=False)
    records = [r for r in records if r.kind in ("run", "step")]
    topic = "tbehind.step"
    service.ownership.warm_until[(topic, 0)] = len(records) + 1  # replaying what was judged before
    service.put([Message(r.kind, topic, 0, offset, b"k", b"", r) for offset, r in enumerate(records)])
    service.tick()
    assert firing(service._unpublished) == []  # warm-up: nothing fires
    service.ownership.warm_until.clear()
    service.tick()
    assert [(a.rule, a.ranks, a.step) for a in firing(service._unpublished)] == [("rank_mismatch", [3], 40)]
    assert service.ticks == 0  # the full tick never ran
