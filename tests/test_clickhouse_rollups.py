"""The rollups (pre-aggregated tables the dashboards read) agree with the exact views,
a retried insert batch is not counted twice in them, and a record sent twice in two
Kafka messages moves only what the module says it moves. chDB in a child process (it
hosts one data directory per process)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
from datetime import datetime, timedelta, timezone
from trainmon.consumers.clickhouse import Target, connect, create_all
from trainmon.consumers.clickhouse.columns import insert_batch
from trainmon.schemas import StepRecord

T0 = datetime(2026, 4, 1, 8, 0, 0, tzinfo=timezone.utc)
def step(rank, n, ms, loss):
    return StepRecord(run_id="r", rank=rank, world_size=3, host=f"node-{rank}", time=T0 + timedelta(seconds=n),
                      event_id=f"s-{rank}-{n}", step=n, step_tokens=100, duration_ms=ms, loss=loss,
                      timers={"fwd": ms / 2})
client = connect(Target(path=sys.argv[1]))
create_all(client)
batch = [step(r, n, 100.0 + 10 * r + n, 3.0 - n / 10 + r) for n in range(4) for r in range(3)]
batch.append(step(1, 4, float("nan"), 2.0))  # a broken timer: left out of the step times
kafka = ("trainmon.step", 0, list(range(len(batch))))
insert_batch(client, "step", batch, kafka=kafka, dedup_token="trainmon.step-0-0-12")
# The loader's retry of the same batch after a lost answer: dropped, by the views too.
insert_batch(client, "step", batch, kafka=kafka, dedup_token="trainmon.step-0-0-12")
q = lambda sql: [list(r) for r in client.query(sql).result_rows]
out = {
    "stats": q("SELECT step, sum(rows), min(min_duration_ms), max(max_duration_ms), "
               "sum(duration_ms_sum) / nullIf(sum(duration_ms_count), 0), "
               "if(sum(duration_ms_count) = 0, NULL, argMaxIfMerge(slowest)), "
               "quantileBFloat16IfMerge(0.5)(duration_ms_quantiles), sum(step_tokens), "
               "sum(loss_sum) / nullIf(sum(loss_count), 0) "
               "FROM trainmon.step_stats GROUP BY step ORDER BY step"),
    "exact": q("SELECT step, ranks_reporting, min_duration_ms, max_duration_ms, mean_duration_ms, "
               "slowest_rank, step_tokens, mean_loss FROM trainmon.step_across_ranks ORDER BY step"),
    "latest": q("SELECT rank, step, duration_ms FROM trainmon.latest_step ORDER BY rank"),
    "buckets": q("SELECT count(), sum(duration_ms_count) FROM trainmon.rank_10s"),
}
# The same record again in another Kafka message (a producer resend): extremes and the
# latest step stay exact, sums count it twice.
insert_batch(client, "step", [batch[0]], kafka=("trainmon.step", 0, [99]), dedup_token="trainmon.step-0-99-99")
out["resent"] = q("SELECT sum(rows), min(min_duration_ms), max(max_duration_ms), sum(step_tokens) "
                  "FROM trainmon.step_stats WHERE step = 0")
out["resent_latest"] = q("SELECT rank, step FROM trainmon.latest_step ORDER BY rank")
print(json.dumps(out))
"""


def test_rollups_match_the_exact_views_and_a_retried_batch_counts_once(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "chdb")], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    exact = {row[0]: row for row in out["exact"]}
    for step_, rows, lo, hi, mean, slowest, median, tokens, loss in out["stats"]:
        want = exact[step_]
        assert rows == want[1], f"step {step_}: {rows} rows aggregated, {want[1]} ranks reported"
        assert [lo, hi, mean, slowest, tokens, loss] == [want[2], want[3], want[4], want[5], want[6], want[7]]
        if step_ < 4:
            assert median == 110.0 + step_  # ranks 0, 1, 2: 100, 110, 120 (+ step)
    assert out["stats"][-1][1:4] == [1, None, None]  # step 4: only the NaN step time
    assert [row[:2] for row in out["latest"]] == [[0, 3], [1, 4], [2, 3]]
    assert out["latest"][0][2] == 103.0 and math.isnan(out["latest"][1][2])  # the latest row as logged
    assert out["buckets"] == [[3, 12]]  # 3 ranks in one 10-second bucket, 12 finite step times
    assert out["resent"] == [[4, 100.0, 120.0, 400]]  # extremes exact; rows and tokens count it twice
    assert out["resent_latest"] == [[0, 3], [1, 4], [2, 3]]


GPU_CHILD = r"""
import json, sys
from datetime import datetime, timedelta, timezone
from trainmon.consumers.clickhouse import Target, connect, create_all
from trainmon.consumers.clickhouse.columns import insert_batch
from trainmon.consumers.clickhouse.rollups import GPU_VALUES, gpu_standing
from trainmon.schemas import GpuRecord

T0 = datetime(2026, 4, 1, 8, 0, 0, tzinfo=timezone.utc)
def gpu(rank, gid, second):
    return GpuRecord(run_id="g", rank=rank, world_size=3, host=f"node-{rank}", time=T0 + timedelta(seconds=second),
                     event_id=f"g-{rank}-{gid}-{second}", step=second, id=gid, clock=1500 + 10 * rank + second,
                     max_clock=1980, power=400_000 + 50_000 * rank + 1000 * gid + second,
                     power_limit=700_000 if (rank, gid) != (2, 1) else 0, temperature=50 + rank + gid,
                     temp_slowdown=89, gpu_util=90 + gid, mem_util=40, dram_free=2**30 * (1 + rank),
                     pcie_rx=1000 * second, pcie_tx=10, fan=0,
                     throttle="hw_slowdown" if (rank, second) == (1, 25) else "sw_power_cap")
client = connect(Target(path=sys.argv[1]))
create_all(client)
# 3 ranks x 2 GPUs every 5 s for 90 s: 10-second buckets, and two minutes.
batch = [gpu(rank, gid, second) for second in range(0, 90, 5) for rank in range(3) for gid in range(2)]
kafka = ("trainmon.gpu", 0, list(range(len(batch))))
insert_batch(client, "gpu", batch, kafka=kafka, dedup_token="trainmon.gpu-0-0-1")
insert_batch(client, "gpu", batch, kafka=kafka, dedup_token="trainmon.gpu-0-0-1")  # the loader's retry
q = lambda sql: [list(r) for r in client.query(sql).result_rows]
out = {}
for name, (row, agg) in GPU_VALUES.items():
    out[name] = {
        "rollup": q(f"SELECT time, min({name}_min), max({name}_max), quantileBFloat16IfMerge(0.5)({name}_median) "
                    f"FROM trainmon.gpu_10s WHERE run_id = 'g' GROUP BY time ORDER BY time"),
        "exact": q(f"SELECT toStartOfInterval(time, INTERVAL 10 second) AS t, min({row}), max({row}), "
                   f"quantileExactLow(0.5)({row}), quantileExactHigh(0.5)({row}) "
                   f"FROM trainmon.gpu WHERE run_id = 'g' GROUP BY t ORDER BY t"),
        "standing": q(f"SELECT rank, id, {gpu_standing(name)} FROM trainmon.gpu_rank_1m WHERE run_id = 'g' "
                      "GROUP BY rank, id ORDER BY rank, id"),
        "exact_standing": q(f"SELECT rank, id, {agg}({row}) FROM trainmon.gpu WHERE run_id = 'g' "
                            "GROUP BY rank, id ORDER BY rank, id"),
    }
out = {"values": out, "rows": q("SELECT sum(power_w_count) FROM trainmon.gpu_rank_1m WHERE run_id = 'g'")}
print(json.dumps(out, default=str))
"""


def test_gpu_rollups_match_the_gpu_rows_and_a_retried_batch_counts_once(tmp_path):
    """gpu_10s (the GPU panels' distribution) and gpu_rank_1m (their standouts) against
    the same numbers computed from the gpu rows: extremes and standings exact, medians
    within bfloat16's 1 %, a NULL value (no power limit) left out, a batch inserted twice
    counted once."""
    done = subprocess.run([sys.executable, "-c", GPU_CHILD, str(tmp_path / "chdb")], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["rows"] == [[3 * 2 * 18]]  # every sample once, the retried batch not again
    for name, got in out["values"].items():
        assert len(got["rollup"]) == 9, name  # 90 s in 10-second buckets
        for (t, lo, hi, median), (t_exact, lo_exact, hi_exact, low, high) in zip(got["rollup"], got["exact"]):
            assert (t[:19], lo, hi) == (t_exact[:19], lo_exact, hi_exact), (name, t)
            # (an even count has two middle values: either is the median)
            assert low * 0.99 - 1e-9 <= median <= high * 1.01 + 1e-9, (name, t, median, low, high)
        assert len(got["standing"]) == 6, name
        for (rank, gid, standing), (_, _, exact) in zip(got["standing"], got["exact_standing"]):
            if exact is None:  # rank 2's GPU 1 has no power limit: no share of it
                assert standing is None and (name, rank, gid) == ("power_percent", 2, 1)
            else:
                assert math.isclose(standing, exact, rel_tol=1e-9), (name, rank, gid, standing, exact)


ALLOCATOR_CHILD = r"""
import json, sys
from datetime import datetime, timedelta, timezone
from trainmon.consumers.clickhouse import Target, connect, create_all
from trainmon.consumers.clickhouse.columns import insert_batch
from trainmon.schemas import AllocatorRecord

T0 = datetime(2026, 4, 1, 8, 0, 0, tzinfo=timezone.utc)
def allocator(rank, second, step):
    segments = [{"name": n, "device": 1000 * rank + 10 * i + second, "managed": 0, "pinned": rank,
                 "pageable": second} for i, n in enumerate(("weights", "gradients", "optimizer"))]
    if rank == 2:
        segments.reverse()  # a producer listing its segments in another order
    return AllocatorRecord(run_id="a", rank=rank, world_size=3, host="h", time=T0 + timedelta(seconds=second),
                           event_id=f"a-{rank}-{second}", step=step, stats=segments, allocated=1)
client = connect(Target(path=sys.argv[1]))
create_all(client)
batch = [allocator(r, s, s) for s in range(0, 30, 5) for r in range(3)]  # 3 ranks every 5 s for 30 s
insert_batch(client, "allocator", batch, kafka=("trainmon.allocator", 0, list(range(len(batch)))),
             dedup_token="trainmon.allocator-0-0-1")
q = lambda sql: [list(r) for r in client.query(sql).result_rows]
segments = ("SELECT time, series, max(v) FROM (SELECT {t} AS time, {names} AS names, {m} AS m FROM trainmon.{table} "
            "WHERE run_id = 'a' GROUP BY time, names) ARRAY JOIN names AS series, m AS v "
            "GROUP BY time, series ORDER BY time, series")
out = {
    "rollup": q(segments.format(t="time", names="names", m="maxForEachMerge(device)", table="allocator_10s")),
    "exact": q(segments.format(t="toStartOfInterval(time, INTERVAL 10 second)", names="stats.name",
                               m="maxForEach(stats.device)", table="allocator")),
    "host": q(segments.format(t="time", names="names", m="maxForEachMerge(host)", table="allocator_10s")),
    "host_exact": q(segments.format(t="toStartOfInterval(time, INTERVAL 10 second)", names="stats.name",
                                    m="maxForEach(arrayMap((p, q) -> p + q, stats.pinned, stats.pageable))",
                                    table="allocator")),
}
print(json.dumps(out, default=str))
"""


def test_allocator_rollups_match_the_allocator_rows(tmp_path):
    """allocator_10s (Memory by segment for every rank of a big run) against the same
    numbers from the allocator rows, segments listed in different orders."""
    done = subprocess.run([sys.executable, "-c", ALLOCATOR_CHILD, str(tmp_path / "chdb")], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["rollup"] == out["exact"] and len(out["rollup"]) == 3 * 3  # 3 buckets x 3 segments
    assert out["host"] == out["host_exact"]


LATEST_CHILD = r"""
import json, sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from trainmon.consumers.clickhouse import Target, connect, create_all
from trainmon.consumers.clickhouse.columns import insert_batch
from trainmon.grafana_sql import ALL, TimeRange, dashboard_queries, expand, load_dashboards
from trainmon.schemas import AllocatorRecord

T0 = datetime(2026, 4, 1, 8, 0, 0, tzinfo=timezone.utc)
def allocator(rank, second, step):
    segments = [{"name": n, "device": 1000 * rank + 10 * i + second, "managed": 0, "pinned": rank,
                 "pageable": second} for i, n in enumerate(("weights", "gradients", "optimizer"))]
    return AllocatorRecord(run_id="a", rank=rank, world_size=3, host="h", time=T0 + timedelta(seconds=second),
                           event_id=f"a-{rank}-{second}", step=step, stats=segments, allocated=1)
client = connect(Target(path=sys.argv[1]))
create_all(client)
def insert(batch, token):
    insert_batch(client, "allocator", batch, kafka=("trainmon.allocator", 0, list(range(len(batch)))),
                 dedup_token=token)
insert([allocator(r, s, s) for s in (0, 5, 10) for r in range(3)], "t-1")
second = [allocator(r, s, s) for s in (15, 20) for r in range(3)]
insert(second, "t-2")
insert(second, "t-2")  # a retried batch
# rank 1 resumed from a checkpoint: its newest sample has an earlier step; rank 2's sample
# of second 1 arrives late, after its newer ones
insert([allocator(1, 25, 3), allocator(2, 1, 1)], "t-3")
panel = next(q.sql for d in load_dashboards(Path("trainmon/grafana/dashboards")) for q in dashboard_queries(d)
             if q.panel == "Latest segments per rank")
sql = expand(panel, TimeRange(T0 - timedelta(hours=1), T0 + timedelta(hours=1), interval_s=10), {"run_id": "a", "rank": ALL})
client.database = "trainmon"
q = lambda s: [list(r) for r in client.query(s).result_rows]
out = {
    "panel": q(sql),
    "exact": q("SELECT rank, segment, device, pinned, pageable FROM ("
               "  SELECT rank, argMax(stats.name, time) AS n, argMax(stats.device, time) AS d,"
               "         argMax(stats.pinned, time) AS p, argMax(stats.pageable, time) AS g"
               "  FROM allocator FINAL WHERE run_id = 'a' GROUP BY rank)"
               " ARRAY JOIN n AS segment, d AS device, p AS pinned, g AS pageable"
               " ORDER BY device DESC, rank, segment"),
    "rows": q("SELECT rank, time, step FROM allocator_latest FINAL ORDER BY rank"),
}
print(json.dumps(out, default=str))
"""


def test_allocator_latest_holds_each_ranks_newest_sample(tmp_path):
    """The Memory dashboard's "Latest segments per rank", read from allocator_latest,
    against the same answer from the allocator rows: over several inserts (parts), a
    retried batch, a rank resumed at an earlier step and a sample that arrives late."""
    done = subprocess.run([sys.executable, "-c", LATEST_CHILD, str(tmp_path / "chdb")], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["panel"] == out["exact"] and len(out["panel"]) == 3 * 3
    rows = {rank: (time[-8:], step) for rank, time, step in out["rows"]}
    assert rows == {0: ("08:00:20", 20), 1: ("08:00:25", 3), 2: ("08:00:20", 20)}
