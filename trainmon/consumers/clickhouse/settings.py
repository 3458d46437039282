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
TABLE_SETTINGS = {"non_replicated_deduplication_window": DEDUP_WINDOW,
                  "min_bytes_for_wide_part": COMPACT_PART_BYTES}

# Every insert into the record tables: a deduplicated block is dropped by the rollups'
# materialized views too (see rollups.py, "Exactly once").
INSERT_SETTINGS = {"deduplicate_blocks_in_dependent_materialized_views": 1}


def settings_sql() -> str:
    """The SETTINGS of every MergeTree table here (record tables and rollups)."""
    return ", ".join(f"{name} = {value}" for name, value in TABLE_SETTINGS.items())
