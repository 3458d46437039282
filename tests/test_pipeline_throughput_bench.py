"""benchmarks/pipeline_throughput.py's pure part, in memory: the rate the pipeline sustained
between 10 % and 90 % of the rows being visible."""

from __future__ import annotations

import pytest

from .benchmark_scripts import load_benchmark

bench = load_benchmark("pipeline_throughput")


def test_the_steady_rate_leaves_out_a_slow_start_and_a_long_tail():
    # 1,000 rows: none for 2 s (start-up), then 100 rows/s, then the last 100 after 5 s more.
    samples = [(0.0, 0), (1.0, 0), (2.0, 0)] + [(2.0 + i, 100 * i) for i in range(1, 10)] + [(16.0, 1000)]
    assert bench.steady_rate(samples, 1000) == pytest.approx(100.0)
    assert 1000 / 16.0 < 100.0  # what the whole span would say


def test_crossings_are_interpolated_between_samples():
    samples = [(0.0, 0), (2.5, 250), (5.0, 500), (7.5, 750), (10.0, 1000)]
    assert bench.steady_rate(samples, 1000) == pytest.approx(100.0)


def test_rows_that_came_in_one_or_two_inserts_give_no_rate():
    assert bench.steady_rate([(0.0, 0), (10.0, 1000)], 1000) is None
    assert bench.steady_rate([(0.0, 0), (5.0, 500), (10.0, 1000)], 1000) is None


def test_no_rate_without_samples_on_both_sides():
    assert bench.steady_rate([], 1000) is None
    assert bench.steady_rate([(0.0, 0), (1.0, 500)], 1000) is None  # never reached 90 %
    assert bench.steady_rate([(0.0, 950), (1.0, 1000)], 1000) is None  # the start was missed


def test_a_run_without_a_rate_is_left_out_of_the_median():
    import math

    assert bench.median_of_measured([3.0, math.nan, 1.0, 2.0]) == 2.0
    assert math.isnan(bench.median_of_measured([math.nan]))


def test_the_jobs_ranks_are_shared_out_evenly_each_rank_once():
    shares = bench.ranks_by_process(16, 2)
    assert [len(share) for share in shares] == [8, 8]
    assert sorted(rank for share in shares for rank in share) == list(range(16))
    assert bench.ranks_by_process(2, 2) == [[0], [1]]  # the workload before 28 Nov
    with pytest.raises(ValueError, match="16 ranks .* 3 producer processes"):
        bench.ranks_by_process(16, 3)
