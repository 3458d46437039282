"""benchmarks/failover.py, shorter: three brokers, four ranks at 50 steps/s and the
ClickHouse service running; the broker that leads most record partitions (and the run's
own partition) is killed with -9 for 11 s, once. Every record logged is in ClickHouse,
duplicates are counted, Kafka's acknowledgements resume before the broker is back (the
longest gap around the kill is under the 11 s outage: the cluster's failover, not the
broker's return, which comes 2-3 s later still), the service loads again without a
restart and the broker comes back into every ISR. The benchmark's targets (a gap <= 10 s,
log_step's latency) are printed, not asserted: on this shared machine the gap was 8.0 s
alone and 10.1 s once under the whole suite's load."""

from __future__ import annotations

import pytest

from .benchmark_scripts import load_benchmark

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

failover = load_benchmark("failover")


OUTAGE_S = 11.0


def test_leader_killed_for_11_s_loses_nothing_and_delivery_resumes_before_it_returns():
    result = failover.run(kills=("leader",), outage_s=OUTAGE_S, settle_s=3.0, reference_s=0)
    res = result["failover"]

    assert res["logged"] > 0 and res["distinct"] == res["logged"], res
    assert isinstance(res["duplicates"], int) and res["duplicates"] >= 0  # reported: rows - distinct ids
    assert res["raised"] == res["dropped"] == res["spilled"] == 0, res
    (kill,) = res["kills"]
    assert kill["run_partition"], kill  # the kill hit the ranks' own partition leader
    assert res["stored_partitions"] == str(res["run_partition"])
    gap = kill["gap"][0]
    assert gap is None or gap < OUTAGE_S, kill
    assert res["service_exits"] == [], "the ClickHouse service had to be restarted"
    assert kill["loading_s"] is not None, "the consumers never loaded a record logged after the kill"
    assert kill["isr_s"] is not None
