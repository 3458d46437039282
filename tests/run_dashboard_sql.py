"""Runs SQL against a fresh chDB holding tests.dashboard_data, in its own process (chDB
hosts one data directory per process). Usage:

    python -m tests.run_dashboard_sql DATA_DIR [--wide] < {"name": sql, ...} > {"name": result}

--wide: the 16,384-rank run of tests.dashboard_data.wide_run_sql instead.

Each result is {"columns": [...], "rows": [[...], ...]} or {"error": "..."}.
"""

from __future__ import annotations

import json
import sys

from tests.dashboard_data import records, wide_run_sql
from trainmon.consumers.clickhouse import Target, connect, create_all, insert_records, refresh_now


def main(path: str, wide: bool = False) -> None:
    queries = json.load(sys.stdin)
    client = connect(Target(path=path))
    create_all(client)
    if wide:
        for sql in wide_run_sql():
            client.command(sql)
    else:
        insert_records(client, records())
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
    main(sys.argv[1], wide="--wide" in sys.argv[2:])
