"""``trainmon consume clickhouse``: the materializer service.

Joins the consumer group (default ``trainmon-clickhouse``), creates / migrates the tables
at start, loads every record topic exactly once (see :mod:`.loader`), answers SQL for
other processes when it runs on embedded chDB (see :mod:`.sql_endpoint`), and on SIGTERM
or Ctrl-C writes its last batch, commits and exits 0. More processes in the same group
share the partitions -- with a ClickHouse server; an embedded chDB directory belongs to
one process.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import replace

from clickhouse_connect.driver.exceptions import OperationalError

from ...kafka_client import bootstrap_servers
from ..runtime import stop_on_signals
from ..serving import add_exit_when_idle_argument, add_metrics_arguments, metrics_options, serve
from .client import EngineBusy, Target, connect, connect_when_free
from .schema_setup import create_all
from .loader import BATCH_MS, BATCH_ROWS, ClickHouseSink
from .sql_endpoint import DEFAULT_LISTEN, SqlEndpoint, listen_problem

log = logging.getLogger("trainmon.clickhouse")


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", help="chDB data directory (default: $TRAINMON_CLICKHOUSE_PATH "
                                       "or ./trainmon-data/chdb)")
    parser.add_argument("--url", help="ClickHouse server URL (default: $TRAINMON_CLICKHOUSE_URL, "
                                      "which is ignored when --path is given)")
    parser.add_argument("--database", help="database (default: $TRAINMON_CLICKHOUSE_DATABASE "
                                           "or trainmon)")


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-rows", type=int, default=BATCH_ROWS,
                        help=f"insert when this many rows are buffered (default {BATCH_ROWS}: fewer, larger "
                             "parts; a trickle is inserted by --batch-ms first)")
    parser.add_argument("--batch-ms", type=int, default=BATCH_MS,
                        help=f"insert buffered rows at the latest after this long (default {BATCH_MS})")
    parser.add_argument("--insert-threads", type=int,
                        default=int(os.environ.get("TRAINMON_CLICKHOUSE_INSERT_THREADS") or 2),
                        help="partitions inserted side by side, each thread with its own "
                             "connection (default: $TRAINMON_CLICKHOUSE_INSERT_THREADS or 2)")
    parser.add_argument("--topic-prefix", default=None,
                        help="topic prefix (default: $TRAINMON_TOPIC_PREFIX or trainmon.)")


def target_from(args) -> Target:
    target = Target.from_env(path=args.path, url=args.url, database=args.database)
    if args.path and not args.url:  # an explicit --path means the embedded engine
        target = replace(target, url=None)
    return target


@contextmanager
def insert_clients(target: Target, count: int):
    """``count`` clients of their own for the loader's insert threads (a chDB handle or a
    server session runs one query at a time)."""
    clients = []
    try:
        for _ in range(max(1, count)):
            clients.append(connect(target))
        yield clients
    finally:
        for client in clients:
            client.close()


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default=os.environ.get("TRAINMON_SQL_LISTEN") or DEFAULT_LISTEN,
                        help="where the SQL endpoint (ClickHouse's HTTP interface on chDB) listens: "
                             "HOST or HOST:PORT (default: $TRAINMON_SQL_LISTEN or 127.0.0.1, any "
                             "free port); beyond loopback it needs --tls-cert and --tls-key")
    parser.add_argument("--tls-cert", default=os.environ.get("TRAINMON_SQL_TLS_CERT"),
                        help="PEM certificate for HTTPS on the SQL endpoint ($TRAINMON_SQL_TLS_CERT)")
    parser.add_argument("--tls-key", default=os.environ.get("TRAINMON_SQL_TLS_KEY"),
                        help="its private key ($TRAINMON_SQL_TLS_KEY)")


@contextmanager
def sql_endpoint_for(target: Target, enabled: bool = True, listen: str | None = None,
                     tls_cert: str | None = None, tls_key: str | None = None):
    """While the block runs, other processes can query an embedded target."""
    if not (enabled and target.embedded):
        yield None
        return
    client = connect(target)
    client.database = target.database  # so people can write FROM step
    try:
        endpoint = SqlEndpoint(client, target.path, listen=listen, database=target.database,
                               tls_cert=tls_cert, tls_key=tls_key).start()
    except BaseException:
        client.close()
        raise
    try:
        yield endpoint
    finally:
        endpoint.stop()
        client.close()


def freeze_start_up_objects() -> None:
    """Python's full collections walk every object the service made at start (pydantic
    models, clickhouse-connect, chDB): 2-6 µs per record loaded, measured. Those live for
    good, so they leave the collector's view, and collections come 70x less often (a
    loaded batch's records form no cycles; the young generation is what they churn)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainmon consume clickhouse",
        description="Load every record topic into typed ClickHouse tables, exactly once.")
    add_target_arguments(parser)
    add_batch_arguments(parser)
    parser.add_argument("--group", default=ClickHouseSink.group,
                        help=f"consumer group (default {ClickHouseSink.group})")
    parser.add_argument("--instance-id", default=os.environ.get("TRAINMON_CLICKHOUSE_INSTANCE_ID"),
                        help="static group membership id, used as given (unique per process): a "
                             "restarted process gets its partitions back at once instead of after "
                             "the 45 s session timeout (default: $TRAINMON_CLICKHOUSE_INSTANCE_ID, "
                             "else $TRAINMON_KAFKA_GROUP_INSTANCE_ID or <group>-<hostname>, with "
                             "-2, -3 ... for more processes of the group on this host)")
    parser.add_argument("--no-sql-endpoint", action="store_true",
                        help="do not answer SQL for other processes")
    add_endpoint_arguments(parser)
    add_exit_when_idle_argument(parser)
    add_metrics_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging()
    target = target_from(args)
    if target.embedded and not args.no_sql_endpoint:
        problem = listen_problem(args.listen, args.tls_cert, args.tls_key)
        if problem:
            log.error("%s", problem)
            return 2
    stop = stop_on_signals()
    try:
        client = connect_when_free(target)
    except EngineBusy as exc:
        log.error("%s", exc)
        return 1
    except OperationalError as exc:  # server unreachable: the supervisor restarts us
        log.error("cannot reach ClickHouse at %s: %s", target.describe(), exc)
        return 1
    try:
        create_all(client, target.database)
        with sql_endpoint_for(target, not args.no_sql_endpoint, args.listen, args.tls_cert,
                              args.tls_key), \
                insert_clients(target, args.insert_threads) as inserting:
            freeze_start_up_objects()
            log.info("loading from %s into %s", bootstrap_servers(), target.describe())
            sink = ClickHouseSink(client, database=target.database, max_rows=args.batch_rows,
                                  max_wait_s=args.batch_ms / 1000, insert_clients=inserting,
                                  storage=target.describe())
            serve(sink, group=args.group, topic_prefix=args.topic_prefix, stop=stop,
                  consumer_settings={"group_instance_id": args.instance_id} if args.instance_id else None,
                  exit_when_idle_s=args.exit_when_idle_s, **metrics_options(args))
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
