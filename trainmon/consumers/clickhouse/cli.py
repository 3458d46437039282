"""``trainmon sql``, ``trainmon replay`` and ``trainmon clickhouse init|ddl``."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import uuid

from ...schemas import RECORD_TYPES
from .client import EngineBusy, Target, connect
from .ddl import create_table_sql
from ..runtime import read_to_end_as_of_now
from ..serving import attach
from .loader import ClickHouseSink
from .schema_setup import create_all
from .service import (add_batch_arguments, add_target_arguments, configure_logging,
                      insert_clients, sql_endpoint_for, target_from)
from .sql_endpoint import SqlQueryError, find_endpoint, query_endpoint, run_sql
from .views import VIEWS

# --format name -> ClickHouse output format; any other name is passed to ClickHouse as is.
FORMATS = {
    "table": "PrettyCompactMonoBlock",
    "csv": "CSVWithNames",
    "tsv": "TSVWithNames",
    "json": "JSONEachRow",
    "jsonl": "JSONEachRow",
}
# NaN / Inf stay visible in JSON ("nan", "inf" rather than null); 64-bit ints are numbers.
OUTPUT_SETTINGS = {
    "output_format_pretty_color": "0",
    "output_format_pretty_row_numbers": "0",
    "output_format_json_quote_denormals": "1",
    "output_format_json_quote_64bit_integers": "0",
}


def query(target: Target, sql: str, fmt: str, settings: dict | None = None) -> bytes:
    """SQL on ``target``: through the running service's endpoint when it holds the
    embedded directory, else with a client of our own."""
    settings = {**OUTPUT_SETTINGS, **(settings or {})}
    if target.embedded:
        info = find_endpoint(target.path)
        if info is not None:
            try:
                return query_endpoint(info, sql, fmt, settings)
            except urllib.error.URLError:
                pass  # its process is gone but not yet reaped: the directory is free
    client = connect(target)
    try:
        if client.command(f"EXISTS DATABASE {target.database}") == 1:
            client.database = target.database
        return run_sql(client, sql, fmt, settings)
    finally:
        client.close()


def sql_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainmon sql", description="Run SQL on the trainmon ClickHouse database and print "
        "the result. Tables and views can be named without the database (FROM step).")
    parser.add_argument("sql", nargs="?", default="-", help="the query ('-' or none: read stdin)")
    parser.add_argument("--format", "-f", default="table",
                        help="table (default), csv, tsv, json (one object a line), or any "
                             "ClickHouse output format name (Vertical, Markdown, ...)")
    add_target_arguments(parser)
    args = parser.parse_args(argv)
    sql = sys.stdin.read() if args.sql == "-" else args.sql
    fmt = FORMATS.get(args.format, args.format)
    try:
        out = query(target_from(args), sql, fmt)
    except (SqlQueryError, EngineBusy) as exc:
        print(f"trainmon sql: {exc}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(out)
    sys.stdout.buffer.flush()
    return 0


def _rows_in(client, database: str) -> int:
    if client.command(f"EXISTS DATABASE {database}") != 1:
        return 0
    return int(client.command("SELECT sum(total_rows) FROM system.tables WHERE database = "
                              "{db:String} AND engine LIKE '%MergeTree'",
                              parameters={"db": database}) or 0)


def replay_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainmon replay",
        description="Rebuild the tables from the topics, from the beginning, into a fresh "
                    "chDB directory (--path) or database (--database); stops when it has "
                    "read everything the topics held at its start. Where retention has removed "
                    "their oldest records it says from when it can rebuild, and does so only "
                    "with --retained.")
    add_target_arguments(parser)
    add_batch_arguments(parser)
    parser.add_argument("--retained", action="store_true",
                        help="rebuild what the topics still hold when retention has trimmed them "
                             "(runs older than the window come back partial or not at all)")
    args = parser.parse_args(argv)
    configure_logging()
    target = target_from(args)
    window = _retained_window(args.topic_prefix)
    if not window.complete and not args.retained:
        print(f"trainmon replay: {window.describe()}: a replay would rebuild only the records since "
              f"{window.since()}, not the history ClickHouse may hold. Run again with --retained to "
              "rebuild that window", file=sys.stderr)
        return 2
    try:
        client = connect(target)
    except EngineBusy as exc:
        print(f"trainmon replay: {exc}", file=sys.stderr)
        return 1
    try:
        existing = _rows_in(client, target.database)
        if existing:
            print(f"trainmon replay: {target.describe()} already holds {existing} rows; replay "
                  "builds a fresh database: choose another --path or --database", file=sys.stderr)
            return 2
        create_all(client, target.database)
        group = f"trainmon-replay-{uuid.uuid4().hex[:12]}"
        with sql_endpoint_for(target), insert_clients(target, args.insert_threads) as inserting:
            sink = ClickHouseSink(client, database=target.database, max_rows=args.batch_rows,
                                  max_wait_s=args.batch_ms / 1000, insert_clients=inserting,
                                  storage=target.describe())
            # A throwaway group: a dynamic member leaves it at close, so it can be deleted
            # (a static member would keep it non-empty).
            loading = attach(sink, group=group, topic_prefix=args.topic_prefix,
                             consumer_settings={"group_instance_id": None})
            loading.run(until=read_to_end_as_of_now(loading.stream, loading.stream.topic_names))
        _delete_group(group)
    finally:
        client.close()
    print(f"replayed {sink.rows_inserted} rows into {target.describe()} "
          f"({loading.stream.dead_letters} dead letters); {window.describe()}")
    return 0


def _retained_window(topic_prefix: str | None):
    """How far back the record topics reach (docs/deploy.md, "Retention and compression")."""
    from ...topics import topic_for
    from ..retained_window import retained_window

    return retained_window([topic_for(kind, topic_prefix) for kind in RECORD_TYPES])


def _delete_group(group: str) -> None:
    from ...kafka_client import KafkaError, delete_group

    try:
        delete_group(group)
    except KafkaError as exc:
        print(f"trainmon replay: could not delete the consumer group {group} (harmless): {exc}",
              file=sys.stderr)


def clickhouse_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainmon clickhouse",
                                     description="Manage the trainmon ClickHouse schema.")
    parser.add_argument("action", choices=["init", "ddl"],
                        help="init: create or migrate database, tables and views; "
                             "ddl: print the SQL that init runs")
    add_target_arguments(parser)
    args = parser.parse_args(argv)
    target = target_from(args)
    if args.action == "ddl":
        db = target.database
        statements = [f"CREATE DATABASE IF NOT EXISTS {db}"]
        statements += [create_table_sql(kind, db) for kind in RECORD_TYPES]
        statements += [sql.format(db=db).strip() for sql in VIEWS.values()]
        print(";\n\n".join(statements) + ";")
        return 0
    try:
        client = connect(target)
    except EngineBusy as exc:
        print(f"trainmon clickhouse init: {exc}; a running service has created the tables "
              "already", file=sys.stderr)
        return 1
    try:
        create_all(client, target.database)
    finally:
        client.close()
    print(f"tables and views ready in {target.describe()}")
    return 0
