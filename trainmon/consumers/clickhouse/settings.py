"""The settings of every table trainmon creates and of every insert it makes.

A leaf: the DDL, the setup that runs it and the writers all read these, and this module
reads none of them.
"""

from __future__ import annotations

# Identical insert blocks (same dedup token) within this many recent blocks are dropped.
DEDUP_WINDOW = 10_000
# A part (the rows of one insert, until merges join parts) smaller than this, uncompressed,
# is written "compact": all its columns in one file instead of two or three files per
# column. ClickHouse's default limit, 10 MB, is below one 50,000-row batch of step records
# (~15 MB): each insert made ~150 files for the step table and its rollups, and creating
# them (ext4 looking for free inodes) took as much of the loader's insert thread as
# ClickHouse's own work. Draining 300,000 step records, alternating runs: insert thread
# 1.7-2.0 s against 1.05-1.1; benchmarks/pipeline_throughput.py's service alone 109-116k
# against 155-167k records/s (measured).
# Merged parts above it are written wide, as ever.
COMPACT_PART_BYTES = 256 << 20
# Outdated parts (the sources of finished merges) are removed one by one by the table's
# cleanup thread, never by ClickHouse's part-cleaning pool. With its default threshold (100
# parts), the first cleanup after a kill -9 found the thousands of parts the dead process
# had not removed yet and started ~100 threads at once to delete them; idle threads stay in
# chDB's global pool for the life of the process (it keeps up to 1,000), and each one that
# later runs part of a query keeps three /proc files open: the service's threads went
# 63 -> 165 and its open files 113 -> 290 over the next minutes (benchmarks/soak.py). Deleting
# a compact part is a few unlinks, so one thread keeps up.
SEQUENTIAL_PART_REMOVAL = 1 << 40
TABLE_SETTINGS = {"non_replicated_deduplication_window": DEDUP_WINDOW,
                  "min_bytes_for_wide_part": COMPACT_PART_BYTES,
                  "concurrent_part_removal_threshold": SEQUENTIAL_PART_REMOVAL}

# Every insert into the record tables: a deduplicated block is dropped by the rollups'
# materialized views too (see rollups.py, "Exactly once").
INSERT_SETTINGS = {"deduplicate_blocks_in_dependent_materialized_views": 1}


def settings_sql() -> str:
    """The SETTINGS of every MergeTree table here (record tables and rollups)."""
    return ", ".join(f"{name} = {value}" for name, value in TABLE_SETTINGS.items())
