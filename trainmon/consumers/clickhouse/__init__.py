"""ClickHouse materializer: every record topic into typed tables, exactly once.

Stable API for other code (tests, demos, dashboards that need data in chDB)::

    from trainmon.consumers.clickhouse import Target, connect, create_all, insert_records
    client = connect(Target(path=tmp_path / "chdb"))   # or connect() for the env's target
    create_all(client)                                  # database trainmon, tables, views
    insert_records(client, records)                     # any mix of pydantic records

``connect(target)`` returns a clickhouse-connect client (chDB embedded or a server);
``create_all(client, database="trainmon")`` creates or migrates the tables and views;
``insert_records(client, records, database="trainmon")`` inserts column batches.
``cli.query(target, sql, fmt)`` runs SQL and returns the bytes ClickHouse rendered in
``fmt`` (e.g. "JSONEachRow"), through a running service's SQL endpoint when it holds the
embedded directory, else with a client of its own (see :mod:`.sql_endpoint`).
chDB hosts one data directory per process: close the client (``client.close()``)
before connecting to another path in the same process.
"""

from .client import DEFAULT_DATABASE, Target, connect
from .columns import insert_records
from .schema_setup import create_all, refresh_now

__all__ = ["DEFAULT_DATABASE", "Target", "connect", "create_all", "insert_records", "refresh_now"]
