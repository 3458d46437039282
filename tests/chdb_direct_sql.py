"""Runs SQL on an existing chDB directory with clickhouse-connect's chDB interface, in
its own process (chDB hosts one data directory per process, and the directory must not
be held by a running service). Usage:

    python -m tests.chdb_direct_sql DATA_DIR DATABASE < {"name": sql, ...} > {"name": result}

Each result is {"columns": [...], "rows": [...]} in tests.ch_values' form, or {"error": "..."}.
"""

from __future__ import annotations

import json
import sys

from tests import ch_values
from trainmon.consumers.clickhouse import Target, connect


def main(path: str, database: str) -> None:
    queries = json.load(sys.stdin)
    client = connect(Target(path=path, database=database))
    client.database = database
    results = {}
    for name, sql in queries.items():
        try:
            result = client.query(sql)
            columns = list(result.column_names)
            if not result.result_rows:  # chDB's Native has no header without rows: ask JSON
                meta = json.loads(client.raw_query(sql, fmt="JSON") or b"{}").get("meta") or []
                columns = [column["name"] for column in meta]
            results[name] = {"columns": columns, "rows": ch_values.rows(result.result_rows)}
        except Exception as exc:  # reported per query so one bad panel names itself
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    client.close()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
