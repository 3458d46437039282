"""The producer-overhead benchmark's own arithmetic (benchmarks/producer_overhead.py): what
wakes a process's threads, and the targets' verdicts against the cheapest peer and wandb.
Pure, in memory: no broker, no tracker imported."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from .benchmark_scripts import load_benchmark

po = load_benchmark("producer_overhead")


def test_wakeups_per_second_by_thread_name():
    before = {1: ("rdk:broker1", 10, 1_000_000), 2: ("rdk:broker1", 5, 0), 3: ("rdk:main", 7, 0)}
    after = {1: ("rdk:broker1", 30, 3_000_000), 2: ("rdk:broker1", 15, 2_000_000), 3: ("rdk:main", 7, 0),
             4: ("late", 4, 400_000)}  # a thread started in the interval counts from nothing

    rates = po.wakeups(before, after, seconds=10.0)

    assert rates["rdk:broker1"] == pytest.approx([3.0, 400.0])  # (20 + 10) / 10 s; 4 ms / 10 s
    assert rates["rdk:main"] == [0.0, 0.0]
    assert rates["late"] == pytest.approx([0.4, 40.0])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_thread_activity_names_python_threads_and_counts_their_wakeups():
    wake, done, finish = threading.Event(), threading.Event(), threading.Event()

    def sleeper():
        wake.wait()
        done.set()
        finish.wait()  # alive for the second reading

    thread = threading.Thread(target=sleeper, name="bench-sleeper")
    thread.start()
    try:
        before = {tid: t for tid, t in po.thread_activity().items() if t[0] == "bench-sleeper"}
        wake.set()
        assert done.wait(5)
        after = po.thread_activity()
    finally:
        wake.set()
        finish.set()
        thread.join(5)
    (tid, (_, switches, _)), = before.items()
    assert tid == thread.native_id
    assert after[tid][1] > switches  # woken once at least


def _case(cpu_s: float, steps: int, elapsed_s: float = 20.0, p99_us: float = 5.0) -> dict:
    return {"cpu_s": cpu_s, "elapsed_s": elapsed_s, "steps": steps, "mean_us": 1.0, "p99_us": p99_us,
            "threads": {"rdk:main": [1.0, 25.0]}}


def test_targets_against_the_cheapest_peer_and_wandb(capsys):
    # CPU per step (µs) at 1 / 10 / 100 steps/s, each 20 steps for simplicity.
    per_step = {"trainmon": (300, 100, 50), "tensorboard": (800, 700, 600),
                "trackio": (4000, 1000, 90), "wandb": (2700, 1400, 900)}
    results = {}
    for name, figures in per_step.items():
        for case, us in zip(("1", "10", "100"), figures):
            results[(name, case)] = _case(us * 20 / 1e6, 20)
        results[(name, "idle")] = _case(0.002 if name == "trainmon" else 0.0, 0)  # 0.01 % of a core
        results[(name, "tight")] = _case(0.1, 20_000, p99_us=25.0 if name == "trainmon" else 9.0)
    results[("trainmon", "10")]["p99_us"] = 30.0
    results[("trainmon", "tight")]["same_length_p99_us"] = 21.5
    for case in ("idle", "1", "10", "100", "tight"):  # the floor: a no-op call, not a peer
        results[(po.FLOOR, case)] = _case(0.0 if case == "idle" else 1e-6, 0 if case == "idle" else 20,
                                          p99_us=13.0)

    po.report(results, [*per_step, po.FLOOR], "confluent-kafka", "load 1", "load 2")
    lines = capsys.readouterr().out.splitlines()

    def verdict(start: str) -> str:
        (line,) = [line for line in lines if line.strip().startswith(start)]
        return line

    assert verdict("CPU per step at 1 steps/s <= 1/2").endswith("(tensorboard): 0.38x (met)")
    assert verdict("CPU per step at 1 steps/s <= 1/10").endswith("0.11x (MISSED)")
    assert verdict("CPU per step at 10 steps/s <= 1/10").endswith("0.07x (met)")
    # At 100 steps/s trackio is the cheapest: 50 / 90.
    assert verdict("CPU per step at 100 steps/s <= 1/2").endswith("(trackio): 0.56x (MISSED)")
    assert not [line for line in lines if line.strip().startswith("CPU per step at 100 steps/s <= 1/10")]
    assert verdict("idle <= 0.02 %").endswith("0.010 % (met)")
    assert verdict("caller p99 <= 20 us (tight loop)").endswith(
        "25.0 us (MISSED; a bare computation as long as its median call: 21.5 us)")
    assert verdict("caller p99 <= 20 us at 1 steps/s").endswith("5.0 us (met; a no-op call's: 13.0 us)")
    assert verdict("caller p99 <= 20 us at 10 steps/s").endswith("30.0 us (MISSED; a no-op call's: 13.0 us)")
    assert any("trainmon" in line and "rdk:main 1.00/s 25 us/s" in line for line in lines)


def test_a_bare_computation_as_long_as_the_median_call_gives_the_machines_own_p99():
    # Calls of a 20 µs median: the computation takes about as long, so its p99 is at least
    # about that (on any machine: the computation is sized by timing it here).
    assert po.same_length_p99([1.0] * 10 + [20.0] * 20 + [90.0] * 10) >= 10.0
    assert po.same_length_p99([0.1] * 10) is None  # a call too short to imitate


def test_ranks_sharing_a_relay_each_count_their_share_of_its_cpu():
    merged = po.merge_ranks([_case(0.002, 20, p99_us=5.0), _case(0.004, 20, p99_us=9.0)], relay_s=0.002)
    assert merged["cpu_s"] == pytest.approx(0.004)  # (0.002 + 0.004 + the relay's 0.002) / 2 ranks
    assert merged["relay_cpu_s"] == pytest.approx(0.001) and merged["ranks"] == 2
    assert merged["p99_us"] == 9.0 and merged["steps"] == 20  # the worst rank's p99


def test_the_relays_cpu_is_taken_over_the_interval_every_rank_measured():
    # The relay burns 0.01 s per second; two ranks measured 10-20 s and 11-21 s (10 s each).
    samples = [(t, 0.5 + 0.01 * t) for t in range(0, 31)]
    samples[0] = (0.0, 0.0)  # its start-up, before any rank measured, is left out
    ranks = [{"t0": 10.0, "t1": 20.0, "elapsed_s": 10.0}, {"t0": 11.0, "t1": 21.0, "elapsed_s": 10.0}]
    assert po.relay_cpu_while_measured(samples, ranks) == pytest.approx(0.1)
    with pytest.raises(SystemExit, match="same time"):
        po.relay_cpu_while_measured(samples, [{"t0": 0.0, "t1": 5.0, "elapsed_s": 5.0},
                                              {"t0": 6.0, "t1": 9.0, "elapsed_s": 3.0}])


def test_repeated_runs_report_each_cases_median_run_and_print_every_run(capsys):
    """--repeats: a case's median run is the one reported (whole: its own p99 with its CPU),
    every run's figure printed beside it; a subset of cases judges only those targets."""
    runs = {("trainmon", "1"): [_case(450e-6 * 20, 20, p99_us=7.0), _case(400e-6 * 20, 20, p99_us=6.0),
                                _case(900e-6 * 20, 20, p99_us=9.0)],
            ("wandb", "1"): [_case(3500e-6 * 20, 20), _case(5100e-6 * 20, 20), _case(4100e-6 * 20, 20)]}
    results = {key: po.median_run(case_runs, key[1]) for key, case_runs in runs.items()}
    assert results[("trainmon", "1")]["p99_us"] == 7.0  # the 450 us run, not a mix of runs
    assert po.median_run(runs[("wandb", "1")][:2], "1") is runs[("wandb", "1")][0]  # (even: the lower)

    po.report(results, ["trainmon", "wandb"], "confluent-kafka", "load 1", "load 2", ["1"], runs)
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert lines[1].startswith("each case run 3 times")
    assert lines[3].split() == ["1/s", "(us/step)", "450", "4100"]
    assert lines[4].split() == ["(runs)", "450/400/900", "3500/5100/4100"]
    assert "CPU per step at 1 steps/s <= 1/10 of wandb's: 0.11x (MISSED)" in lines
    assert not [line for line in lines if line.startswith(("idle <=", "caller p99 <= 20 us (tight"))]


def test_the_floor_is_called_as_trainmon_is_with_the_values_made_before_the_call():
    log, close = po.make_logger(po.FLOOR, bootstrap="unused", tmp="unused")
    metrics = po.metrics_for(po.FLOOR)

    assert metrics is po.metrics_for("trainmon")  # log_step's keyword arguments
    assert log(7, metrics(7)) is None  # (called as log_step is: step, **values)
    assert set(po.metrics_for("wandb")(7)) == {f"train/{name}" for name in metrics(7)}
    close()


def _spin(seconds: float, done: threading.Event) -> None:
    until = time.thread_time() + seconds  # this thread's own CPU: it spins for that long
    while time.thread_time() < until:
        pass
    done.set()


def test_a_case_is_read_once_the_work_its_calls_left_behind_is_done():
    """A library's thread still sending what the loop queued is part of the loop's cost:
    the CPU is read only once the process went quiet."""
    cpu = po.ProcessCpu()
    done = threading.Event()
    worker = threading.Thread(target=_spin, args=(0.4, done))
    worker.start()
    try:
        assert cpu.settle(quiet_s=0.3, timeout_s=30)
        assert done.is_set()
        assert cpu.used_s() >= 0.4
    finally:
        worker.join(30)


def test_a_process_that_stays_busy_is_read_at_the_timeout():
    cpu = po.ProcessCpu()
    done = threading.Event()
    worker = threading.Thread(target=_spin, args=(3.0, done))
    worker.start()
    try:
        started = time.monotonic()
        assert not cpu.settle(quiet_s=0.3, timeout_s=0.8)
        assert not done.is_set() and time.monotonic() - started < 3.0
    finally:
        worker.join(30)
