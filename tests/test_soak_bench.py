"""benchmarks/soak.py's pure parts, in memory: the slope of a resource within each process
life and its noise bound, and the exactly-once query run on chDB (no broker)."""

from __future__ import annotations

import random

import pytest

from .benchmark_scripts import load_benchmark
from .waiting import wait_until

soak = load_benchmark("soak")

HOUR = 3600.0


def every_10_s(minutes: float) -> list[float]:
    return [i * 10.0 for i in range(int(minutes * 6))]


def test_a_leak_is_measured_per_hour_and_is_not_flat():
    samples = [("pid-1", t, 300.0 + 12.0 * t / HOUR) for t in every_10_s(30)]  # 12 MiB/h
    fit = soak.slope_within_lives(samples)
    assert fit.slope_per_h == pytest.approx(12.0)
    assert fit.stderr_per_h == pytest.approx(0.0, abs=1e-9)
    # The floor, a change over the run itself: 5.4 MiB over 30 min is 10.8 MiB/h, under the leak.
    assert not soak.is_flat(fit, floor_over_run=5.4, hours=0.5)
    assert soak.is_flat(fit, floor_over_run=6.6, hours=0.5)  # 13.2 MiB/h: a leak that small is let pass


def test_restarts_are_new_lives_not_growth():
    """A consumer killed and restarted comes back lower and levels off at its own level: fit
    over all samples at once that sawtooth reads as a slope; within each life it is flat."""
    rng = random.Random(7)
    samples = []
    for life, (start, level) in enumerate([(0, 200.0), (600, 150.0), (1200, 250.0)]):
        samples += [(life, start + t, level + rng.gauss(0, 2)) for t in every_10_s(10)]
    fit = soak.slope_within_lives(samples)
    assert fit.lives == 3 and fit.samples == len(samples)
    assert soak.is_flat(fit, floor_over_run=0.0, hours=0.5)  # within two standard errors of zero
    pooled = soak.slope_within_lives([(0, t, v) for _, t, v in samples])
    assert abs(pooled.slope_per_h) > 50 and not soak.is_flat(pooled, 0.0, 0.5)


def test_noise_alone_is_flat_and_the_bound_is_two_standard_errors():
    rng = random.Random(1)
    fit = soak.slope_within_lives([("p", t, 100 + rng.gauss(0, 5)) for t in every_10_s(30)])
    assert soak.noise_bound(fit, floor_over_run=0.0, hours=0.5) == pytest.approx(2 * fit.stderr_per_h)
    assert soak.is_flat(fit, 0.0, 0.5)


def test_integer_counts_that_never_change_are_flat():
    fit = soak.slope_within_lives([("p", t, 14) for t in every_10_s(30)])
    assert fit.slope_per_h == 0 and fit.stderr_per_h == 0
    assert soak.noise_bound(fit, floor_over_run=2, hours=0.5) == pytest.approx(4.0)  # 2 fds over 30 min
    assert soak.is_flat(fit, 2, 0.5)


def test_too_few_samples_give_no_slope():
    assert soak.slope_within_lives([]) is None
    assert soak.slope_within_lives([("a", 0, 1.0), ("b", 10, 2.0), ("c", 20, 3.0)]) is None  # one each
    assert soak.slope_within_lives([("a", 0, 1.0), ("a", 10, 2.0)]) is None  # no freedom left for an error


@pytest.fixture
def client(tmp_path):
    from trainmon.consumers.clickhouse.client import Target, connect
    from trainmon.consumers.clickhouse.ddl import create_table_sql

    client = connect(Target(path=tmp_path / "chdb"))
    client.command("CREATE DATABASE IF NOT EXISTS trainmon")
    for kind in soak.KINDS:  # the loader's tables for the soak's kinds, as it creates them
        client.command(create_table_sql(kind, "trainmon"))
    yield client
    client.close()


def insert(client, kind: str, run_id: str, event_ids: list[str]) -> None:
    client.insert(kind, [[run_id, 0, i, event_id] for i, event_id in enumerate(event_ids)],
                  column_names=["run_id", "rank", "step", "event_id"], database="trainmon")


def test_the_exactly_once_query_finds_copies_and_missing_records(client):
    """Run on chDB: a copy stored twice (same event id, not merged away) counts twice in
    rows but once in distinct ids; a missing record is fewer distinct ids than logged;
    another run's rows and a quote in the run id do not confuse it."""
    run = "soak-o'brien"
    insert(client, "step", run, ["s0", "s1", "s2"])
    insert(client, "step", run, ["s2"])  # a second insert: a part of its own, so not merged yet
    insert(client, "gpu", run, ["g0", "g1"])
    insert(client, "allocator", run, ["a0"])
    insert(client, "step", "other-run", ["s0", "x"])

    rows = client.query(soak.exactly_once_sql(run)).result_rows
    checks = {c.kind: c for c in soak.exactly_once_checks(rows, {"step": 3, "gpu": 3, "allocator": 1})}
    assert (checks["step"].stored, checks["step"].distinct, checks["step"].exactly_once) == (4, 3, False)
    assert (checks["gpu"].stored, checks["gpu"].distinct, checks["gpu"].exactly_once) == (2, 2, False)
    assert (checks["allocator"].stored, checks["allocator"].exactly_once) == (1, True)


def test_a_kind_with_no_rows_is_none_stored():
    checks = soak.exactly_once_checks([("step", 5, 5)], {"step": 5, "gpu": 2})
    assert [(c.kind, c.stored, c.exactly_once) for c in checks] == [("gpu", 0, False), ("step", 5, True)]


def test_a_live_threads_procfs_handles_are_counted_apart_from_open_files():
    """This process opens its own thread's procfs files (as chDB does per pooled thread) and
    an ordinary file: the first are thread handles, the second an open file; once the thread
    is gone, a handle it left open counts as an open file again (a leak stays a leak)."""
    import os
    import threading

    files_before, handles_before = soak.open_files(os.getpid())
    opened, ready, done = [], threading.Event(), threading.Event()

    def keep_own_stat_open():
        opened.append(open("/proc/thread-self/stat"))
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=keep_own_stat_open)
    thread.start()
    try:
        assert ready.wait(10), "the thread did not open its stat file"  # (counted only then)
        with open(__file__) as ordinary:
            files, handles = soak.open_files(os.getpid())
            assert (files, handles) == (files_before + 1, handles_before + 1)
            assert ordinary.readable()
    finally:
        done.set()
        thread.join()
    # (join returns once the Python thread is done; the kernel's task may linger a moment)
    wait_until(lambda: not os.path.exists(f"/proc/self/task/{thread.native_id}"), 10, "the thread's task gone")
    try:
        files, handles = soak.open_files(os.getpid())
        assert (files, handles) == (files_before + 1, handles_before)
    finally:
        opened[0].close()


def test_the_sample_with_most_thread_handles_per_thread_is_reported():
    samples = [(1, 0.0, {"thread_fds": 30, "threads": 60}), (1, 10.0, {"thread_fds": 90, "threads": 40}),
               (2, 20.0, {"thread_fds": 100, "threads": 64})]
    assert soak.most_thread_handles(samples) == (90, 40)
