"""Runs SQL against a fresh chDB holding tests.dashboard_data, in its own process (chDB
hosts one data directory per process). Usage:

    python -m tests.run_dashboard_sql DATA_DIR [--wide | --records FILE] [--twice] < {"name": sql, ...} > {"name": result}

--wide: the 16,384-rank run of tests.dashboard_data.wide_run_sql instead; --records: the
records of FILE instead, one {"kind", "record"} per line (tests/data/gpu/); --twice: every
record inserted a second time, in other blocks (as Kafka stores a message twice when a
send is retried: the insert dedup does not see it, the tables keep one row per event id).

Each result is {"columns": [...], "rows": [[...], ...]} or {"error": "..."}.
"""

from __future__ import annotations

import json
import sys

from tests.dashboard_data import records, wide_run_sql
from trainmon.consumers.clickhouse import Target, connect, create_all, insert_records, refresh_now
from trainmon.schemas import decode


def records_of(path: str) -> list:
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    return [decode(line["kind"], json.dumps(line["record"]).encode()) for line in lines]


def main(path: str, wide: bool = False, records_file: str | None = None, twice: bool = False) -> None:
    queries = json.load(sys.stdin)
    client = connect(Target(path=path))
    create_all(client)
    if wide:
        for sql in wide_run_sql():
            client.command(sql)
    else:
        loaded = records_of(records_file) if records_file else records()
        insert_records(client, loaded)
        if twice:
            insert_records(client, loaded[::-1])
    refresh_now(client)  # (the goodput panel's table, else recomputed within a minute)
    client.database = "trainmon"  # as Grafana's data source with defaultDatabase does
    results = {}
    for name, sql in queries.items():
        try:
            result = client.query(sql)
            results[name] = {"columns": list(result.column_names),
                             "rows": [[repr(v) for v in row] for row in result.result_rows]}
        except Exception as exc:  # reported per query so one bad panel names itself
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    client.close()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    options = sys.argv[2:]
    main(sys.argv[1], wide="--wide" in options,
         records_file=options[options.index("--records") + 1] if "--records" in options else None,
         twice="--twice" in options)
