"""Two alerts engines in one consumer group on the real broker: each judges whole runs.

Six runs of 4 ranks, keyed by run, over topics of 4 partitions; the group's range assignor
gives each engine two partition numbers of every topic, so every rank and kind of a run
reaches one engine. One engine starts alone (phase 0, steps 0-7), a second joins and takes
half the runs over. Each run then has cross-rank incidents with ranks of its own: a
straggler (rank i % 4, steps 10-19) that fires and resolves, a second one (rank
(i + 2) % 4, steps 30-44) still open when the second engine stops, and, after the stop, a
rank ((i + 1) % 4) that stops at step 55 while the others go on (rank_mismatch). The first
engine takes the stopped one's runs over at the rebalance: on the alert topic every
incident fires exactly once, naming its ranks, the open straggler resolves once, and
nothing else fires.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import ExitStack

from trainmon import topics
from trainmon.consumers.alerts import checkpoint
from trainmon.consumers.alerts.engine import INPUT_KINDS
from trainmon.consumers.alerts.ownership import Ownership
from trainmon.kafka_client import Consumer, TopicPartition, group_lag

from .alerts_support import (BackgroundService, engine_with, past_t0, run_engine, send, service_env,
                             synthetic_run, wait_for)
from .conftest import read_records

RUNS = [f"scale-{c}" for c in "abcdef"]  # by murmur2 on partitions 3, 1, 0, 3, 2, 0: all four
RANKS, STEPS, WARM_UP, PHASE_2, STOPS_AT = 4, 80, 8, 40, 55
# Record seconds per step: a whole run spans 20 s, so however far one kind's topic is read
# ahead of the step topic (moving the run's clock), no step looks long overdue to a rule.
DT = 0.25


def short_straggler(i: int) -> int:
    return i % RANKS


def open_straggler(i: int) -> int:
    return (i + 2) % RANKS


def stopping_rank(i: int) -> int:
    return (i + 1) % RANKS


def records(i: int, run: str, t0: float, first: int, last: int, **kw):
    def slow(s, r, step, gpu, moe):
        if (r == short_straggler(i) and 10 <= s <= 19) or (r == open_straggler(i) and 30 <= s <= 44):
            step["duration_ms"] = 1600.0  # 1.6x its peers' (straggler factor 1.3)

    return synthetic_run(run, t0=t0, ranks=RANKS, steps=last + 1, first_step=first, dt=DT, seed=i,
                         mutate=slow, end=False, **kw)


def expected_after_phase_1() -> Counter:
    out = Counter()
    for i, run in enumerate(RUNS):
        out[(run, "straggler", (short_straggler(i),), "firing", 14)] += 1  # 5 slow steps in a row
        out[(run, "straggler", (short_straggler(i),), "resolved", 20)] += 1  # the first healthy one
        out[(run, "straggler", (open_straggler(i),), "firing", 34)] += 1
    return out


def expected_at_the_end() -> Counter:
    out = expected_after_phase_1()
    for i, run in enumerate(RUNS):
        out[(run, "straggler", (open_straggler(i),), "resolved", 45)] += 1
        out[(run, "rank_mismatch", (stopping_rank(i),), "firing", STOPS_AT)] += 1
    return out


def test_two_engines_share_the_runs_and_each_incident_fires_once(bootstrap, topic_prefix, make_producer,
                                                                  tmp_path):
    # Mismatch by record time (the stopped rank ends 6 s behind); a stopped engine's runs
    # move after the broker's shortest session timeout.
    env = service_env(bootstrap, rank_mismatch_grace_s=3, wall_clock_slack_s=1.5, session_timeout_s=6)
    state = tmp_path / "state"  # shared: each member writes its own checkpoint
    group = f"{topic_prefix}alerts"
    input_topics = [topics.topic_for(k, topic_prefix) for k in INPUT_KINDS]
    producer = make_producer()
    t0 = time.time() - (STEPS + 1) * DT  # the runs' last steps are about now: live, no stall
    first, second = BackgroundService(env, topic_prefix, state), BackgroundService(env, topic_prefix, state)
    engines = [first, second]

    def details() -> str:
        return " | ".join(e.describe() for e in engines)

    def numbers(engine: BackgroundService) -> set[int]:
        return {tp.partition for tp in engine.service.ownership.assigned}

    def settled(*running: BackgroundService) -> bool:
        """The group's input is read and committed, and each running engine has ticked
        (and published what the tick found) since."""
        if group_lag(group, input_topics, bootstrap=bootstrap) != 0:
            return False
        ticks = [e.service.ticks for e in running]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if all(e.service.ticks >= t + 2 for e, t in zip(running, ticks)):
                return True
            time.sleep(0.1)
        return False

    def alerts(expected: Counter) -> Counter:
        """(run, rule, ranks, state, step) of every alert on the topic, counted: a double fire
        would count 2 (or add a key), however the publisher deduplicates."""
        got = read_records(bootstrap, topic_prefix, "alert", sum(expected.values()), timeout=60)
        assert len({a.event_id for a in got}) == len(got), "an alert was published twice"
        firing = [a for a in got if a.state == "firing"]
        assert len({a.incident_id for a in firing}) == len(firing)
        for a in got:
            if a.rule == "straggler":  # an incident per rank, named after it
                assert a.incident_id.startswith(f"{a.run_id}/straggler/rank{a.ranks[0]}#"), a.incident_id
        return Counter((a.run_id, a.rule, tuple(a.ranks), a.state, a.step) for a in got)

    def owned(engine: BackgroundService) -> set[str]:
        return set(engine.service.engine.runs)

    with ExitStack() as running:
        # Phase 0, one engine: it reads every partition, so it judges every run.
        running.enter_context(first)
        wait_for(lambda: numbers(first) == {0, 1, 2, 3}, 60, "the first engine assigned", details)
        probe = Consumer(None, bootstrap=bootstrap)
        try:
            assert {len(probe.partitions_for(t)) for t in input_topics} == {4}
        finally:
            probe.close()
        send(producer, [r for i, run in enumerate(RUNS) for r in records(i, run, t0, 0, WARM_UP - 1)])
        wait_for(lambda: settled(first), 60, "phase 0 judged", details)
        assert owned(first) == set(RUNS)

        # A second engine joins: the group shares the partition numbers out, the first
        # engine lets go of the runs it no longer reads, the second replays their records
        # as warm-up. Then phase 1 brings each run a straggler that fires and resolves and
        # one still open at its end.
        running.enter_context(second)
        wait_for(lambda: numbers(first) and numbers(second) and not numbers(first) & numbers(second)
                 and numbers(first) | numbers(second) == {0, 1, 2, 3}, 60, "both engines assigned", details)
        send(producer, [r for i, run in enumerate(RUNS) for r in records(i, run, t0, WARM_UP, PHASE_2 - 1)])
        wait_for(lambda: settled(first, second), 60, "phase 1 judged", details)
        assert alerts(expected_after_phase_1()) == expected_after_phase_1()

        # Every rank of a run reached one engine; each engine judged runs of its own.
        assert owned(first).isdisjoint(owned(second)), details()
        assert owned(first) | owned(second) == set(RUNS), details()
        assert owned(first) and owned(second), details()  # the test's premise: both engines busy
        for e in engines:
            assert all(set(r.ranks) == set(range(RANKS)) for r in e.service.engine.runs.values()), details()
            assert e.service.stats["alerts"] > 0
        assert second.service.stats["warmup"] > 0  # phase 0 of its runs, judged by the first

        # The second engine stops (its normal path: checkpoint, close). More records come:
        # its runs' open straggler goes on and recovers, then a rank stops in every run.
        moved = owned(second)
        second.stop()
        phase_2 = []
        for i, run in enumerate(RUNS):
            phase_2 += records(i, run, t0, PHASE_2, STEPS - 1, stop_rank_at={stopping_rank(i): STOPS_AT})
        send(producer, phase_2)
        warm_before = first.service.stats["warmup"]
        wait_for(lambda: numbers(first) == {0, 1, 2, 3} and settled(first), 90,
                 "the first engine takes every partition and judges phase 2", details)
        assert alerts(expected_at_the_end()) == expected_at_the_end()
        assert owned(first) == set(RUNS) and moved, details()
        assert first.service.stats["warmup"] > warm_before  # the moved runs' records, for windows
        assert all(set(r.ranks) == set(range(RANKS)) for r in first.service.engine.runs.values())

    # One checkpoint per member in the shared state directory.
    assert first.service.path != second.service.path
    assert first.service.path.exists() and second.service.path.exists()


def test_reading_the_alert_topic_again_changes_nothing():
    """The book takes its own alerts back from the topic (at every assignment and
    checkpoint), in any order among equal times: a resolved incident stays resolved, an
    escalated one stays superseded, and nothing counts twice against the rate limit."""
    def anomalies(s, r, step, gpu, moe):
        if s == 10:
            step["loss"] = float("nan")  # fires and resolves
        if s == 40:
            step["norm"] = 2e5  # fires, then escalates at 41 (#1 superseded by #2)
        if s == 41:
            step["norm"] = 3e6
        if r == 2 and s >= 50:
            step["duration_ms"] = 1600.0  # a straggler still open at the end
    engine = engine_with()
    alerts = run_engine(engine, synthetic_run("again", t0=past_t0(), ranks=4, steps=60, mutate=anomalies,
                                              end=False))
    assert {(a.rule, a.state) for a in alerts} >= {("non_finite", "resolved"), ("grad_spike", "resolved"),
                                                   ("straggler", "firing")}
    before = engine.book.dump()
    for order in (alerts, sorted(alerts, key=lambda a: a.time), sorted(alerts, key=lambda a: a.time)[::-1]):
        for alert in order:
            engine.book.apply(alert)
        assert engine.book.dump() == before


def test_a_rebalance_keeps_the_state_that_stays_and_rewinds_what_comes():
    step, gpu = "p.step", "p.gpu"
    own = Ownership()
    assert own.assign([TopicPartition(t, p) for t in (step, gpu) for p in (0, 1)]) == []
    assert own.start(TopicPartition(step, 0), None, 100) is None  # a new group: from the start
    assert own.start(TopicPartition(gpu, 0), 30, 0) is None  # no rebuild: from the commit on
    own.saw(step, 0, 10, "run-a")
    own.saw(step, 1, 20, "run-b")
    own.saw(gpu, 1, 7, "run-b")

    # Partition 1 goes to another engine: its run is released, its position forgotten.
    assert own.assign([TopicPartition(step, 0), TopicPartition(gpu, 0)]) == ["run-b"]
    assert own.start(TopicPartition(step, 0), 11, 100) == 11  # where this engine's state goes on
    assert own.start(TopicPartition(gpu, 0), 60, 100) == 30  # kept, though nothing came: not rewound
    assert own.checkpoint_offsets() == {f"{step}:0": 11, f"{gpu}:0": 30}

    # It comes back with 30 more records judged elsewhere: rewound, replayed as warm-up.
    own.assign([TopicPartition(t, p) for t in (step, gpu) for p in (0, 1)])
    assert own.start(TopicPartition(step, 1), 51, 40) == 11
    assert own.saw(step, 1, 11, "run-b") and own.saw(step, 1, 50, "run-b")  # warm-up
    assert not own.saw(step, 1, 51, "run-b")  # new: judged here
    assert own.holds_all_of(step, [0, 1]) and not own.holds_all_of("p.new", [0, 1])
    assert own.holds_all_of("p.new", [2, 3])  # numbers another engine holds


def test_each_member_has_its_own_checkpoint(tmp_path):
    paths = {checkpoint.checkpoint_path(tmp_path, "alerts", "t.", member) for member in ("a-host", "a-host-2", None)}
    assert len(paths) == 3
