"""One loader batch of step records is written as compact parts (one file for all its
columns), in a new database and in one an older version made with ClickHouse's default
limit (see settings.COMPACT_PART_BYTES); and a restart after a kill removes the dead
process's outdated parts without a burst of threads (settings.SEQUENTIAL_PART_REMOVAL).
chDB in a child process (it hosts one data directory per process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
from trainmon.consumers.clickhouse import Target, connect, create_all
from trainmon.consumers.clickhouse.columns import insert_json, json_body
from trainmon.consumers.clickhouse.rollups import rollups

client = connect(Target(path=sys.argv[1]))
create_all(client)
if sys.argv[2] == "older":  # tables as an older version left them: ClickHouse's default limit
    for table in ["step", *rollups("trainmon")]:
        client.command(f"ALTER TABLE trainmon.{table} RESET SETTING min_bytes_for_wide_part")
    create_all(client)  # the next start
line = ('{"run_id":"parts","rank":%d,"world_size":2,"host":"h","time":"2026-04-01T08:00:00.%06dZ",'
        '"event_id":"e-%d","schema_version":1,"step":%d,"epoch":0.0,"step_tokens":4096,'
        '"duration_ms":250.0,"loss":2.0,"norm":1.0,"lr":0.0003,"tokens_per_second":16384.0,'
        '"timers":{"forward":80.0,"backward":160.0}}')
rows = [(line % (i % 2, i % 1000000, i, i // 2)).encode() for i in range(50000)]
insert_json(client, "step", json_body(("trainmon.step", 0, list(range(len(rows)))), rows),
            database="trainmon", dedup_token="parts-0")
print(json.dumps([list(r) for r in client.query(
    "SELECT table, part_type, sum(data_uncompressed_bytes) FROM system.parts "
    "WHERE database = 'trainmon' AND active AND table IN ('step', 'step_stats') GROUP BY ALL").result_rows]))
"""


def parts(tmp_path, tables: str) -> dict[str, tuple[str, int]]:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "chdb"), tables],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return {table: (kind, size) for table, kind, size in json.loads(done.stdout)}


def test_a_batch_of_steps_is_written_compact(tmp_path):
    written = parts(tmp_path, "new")
    assert written["step"][1] > 10 << 20  # above ClickHouse's default limit for compact parts
    assert written == {"step": ("Compact", written["step"][1]),
                       "step_stats": ("Compact", written["step_stats"][1])}


def test_tables_of_an_older_version_get_the_setting_at_the_next_start(tmp_path):
    written = parts(tmp_path, "older")
    assert {table: kind for table, (kind, _) in written.items()} == {"step": "Compact", "step_stats": "Compact"}


# Leaves outdated parts behind as a killed service does: many small inserts, merged, and the
# process gone without shutting ClickHouse down (os._exit, as after kill -9).
KILLED = r"""
import os, sys
from trainmon.consumers.clickhouse import Target, connect, create_all
from trainmon.consumers.clickhouse.columns import insert_json, json_body

client = connect(Target(path=sys.argv[1]))
create_all(client)
line = ('{"run_id":"parts","rank":0,"world_size":1,"host":"h","time":"2026-04-01T08:00:00.%06dZ",'
        '"event_id":"e-%d","schema_version":1,"step":%d,"loss":2.0}')
for i in range(int(sys.argv[2])):
    insert_json(client, "step", json_body(("trainmon.step", 0, [i]), [(line % (i, i, i)).encode()]),
                database="trainmon", dedup_token=f"killed-{i}")
client.command("OPTIMIZE TABLE trainmon.step FINAL")
print(client.query("SELECT count() FROM system.parts WHERE database = 'trainmon' AND table = 'step' "
                   "AND NOT active").result_rows[0][0], flush=True)
os._exit(0)
"""

# Opens the directory again and reports its threads until the outdated parts are gone.
RESTARTED = r"""
import json, os, sys, time
from trainmon.consumers.clickhouse import Target, connect

client = connect(Target(path=sys.argv[1]))
threads = lambda: len(os.listdir("/proc/self/task"))
at_open, most = threads(), 0
deadline = time.monotonic() + 150
while time.monotonic() < deadline:
    most = max(most, threads())
    left = client.query("SELECT count() FROM system.parts WHERE database = 'trainmon' AND NOT active").result_rows[0][0]
    if left == 0:
        break
    time.sleep(0.2)
print(json.dumps({"at_open": at_open, "most": most, "after": threads(), "outdated_left": left}))
"""


@pytest.mark.slow
def test_a_restart_after_a_kill_removes_old_parts_without_a_burst_of_threads(tmp_path):
    """With ClickHouse's default (parts removed by a pool once a table has 100 outdated),
    the first cleanup after the restart started ~100 threads that chDB then kept for the
    life of the process."""
    chdb = str(tmp_path / "chdb")
    killed = subprocess.run([sys.executable, "-c", KILLED, chdb, "150"], capture_output=True,
                            text=True, cwd=REPO, timeout=120)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert int(killed.stdout) >= 150  # outdated parts the dead process left behind
    restarted = subprocess.run([sys.executable, "-c", RESTARTED, chdb], capture_output=True,
                               text=True, cwd=REPO, timeout=200)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    seen = json.loads(restarted.stdout)
    assert seen["outdated_left"] == 0, seen
    assert seen["most"] - seen["at_open"] < 30, seen
