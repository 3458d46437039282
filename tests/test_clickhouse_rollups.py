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
