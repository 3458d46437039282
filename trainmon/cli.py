"""The ``trainmon`` command line.

Small commands live here; the bigger ones are delegated to their own modules, each with
its own ``main(argv)``, so this file stays an index of what trainmon can do.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from .consumers import registry

# command -> (module:function, the extra that brings its dependencies, one line for --help)
DELEGATED = {
    "ingest": ("trainmon.ingest.cli:main", None,
               "read a training job's console log (Megatron, NeMo, torchtitan, nanoGPT, HF, ...) into records"),
    "sql": ("trainmon.consumers.clickhouse.cli:sql_main", "clickhouse", "run SQL on the trainmon tables"),
    "report": ("trainmon.report:main", "report", "write the HTML report of a run (the newest by default)"),
    "goodput": ("trainmon.goodput:main", "clickhouse",
                "where a job's wall time went (training, start-up, saves, restarts, hangs, ...)"),
    "replay": ("trainmon.consumers.clickhouse.cli:replay_main", "clickhouse",
               "rebuild the ClickHouse tables from the topics, from offset 0"),
    "clickhouse": ("trainmon.consumers.clickhouse.cli:clickhouse_main", "clickhouse",
                   "ClickHouse housekeeping: create the tables, print the DDL"),
    "demo": ("trainmon.demo:main", "demo", "the demo: broker, consumers, a 4-rank CPU training run, a report"),
    "relay": ("trainmon.relay.server:main", None,
              "one per node: send the node's ranks' records to Kafka, packed across ranks (TRAINMON_RELAY)"),
    "roundtrip": ("trainmon.roundtrip:main", None, "send a few records through a throwaway broker and read them back"),
    "grafana": ("trainmon.grafana_provision:main", "clickhouse",
                "Grafana for the stack: 'provision --out DIR' writes data source, dashboards, alert rule"),
}
# consumer -> (module:function, extra), from the one list of consumers (consumers/registry.py)
CONSUMERS = {c.name: (c.main, c.extra) for c in registry.CONSUMERS}


def _call(target: str, extra: str | None, argv: list[str], streaming: bool = False) -> int:
    module_name, func = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and not exc.name.startswith("trainmon") and extra:
            print(f"trainmon: {exc.name!r} is not installed: pip install 'trainmon[{extra}]'",
                  file=sys.stderr)
            return 2
        raise
    if streaming:
        from .consumers.gc_tuning import tune_for_streaming

        tune_for_streaming()
    return getattr(module, func)(argv) or 0


def _default_broker_dir() -> Path:
    from .broker import cache_dir

    return Path(os.environ.get("TRAINMON_BROKER_DIR") or cache_dir() / "broker")


def cmd_broker(args) -> int:
    from . import broker, topics

    if args.action == "fetch":
        print(broker.fetch())
        return 0
    # Without --port: the port the broker of this data directory was started with, else
    # Kafka's usual 9092 for a new one.
    env_port = os.environ.get("TRAINMON_BROKER_PORT") or "0"
    if not args.port and not (env_port.isdigit() and int(env_port) < 65536):
        print(f"trainmon broker: TRAINMON_BROKER_PORT={env_port!r} is not a port number", file=sys.stderr)
        return 2
    port = args.port or int(env_port)
    state = Path(args.data_dir) / ("node-1" if args.nodes > 1 else "") / "broker.json"
    if not port and not state.exists():
        port = 9092
    if args.nodes > 1:
        b = broker.Cluster(args.data_dir, nodes=args.nodes, heap=args.heap)
        for i, node in enumerate(b.brokers):
            if port:  # client ports port, port + 1, ... (as trainmon up's)
                node.port = port + i
    else:
        b = broker.Broker(args.data_dir, port=port, heap=args.heap)
    running = all(b.running()) if args.nodes > 1 else b.running()
    if args.action == "start":
        b.start()
        b.create_topics(topics.all_topics())
        print(f"Kafka running on {b.bootstrap} ({args.nodes} node(s); data in {b.data_dir})")
        print(f"export TRAINMON_KAFKA_BOOTSTRAP={b.bootstrap}")
    elif args.action == "stop":
        b.stop()
        print("Kafka stopped")
    else:
        print(f"running on {b.bootstrap}" if running else "not running")
        return 0 if running else 1
    return 0


def consume_main(argv: list[str]) -> int:
    """``trainmon consume NAME [its options]``, ``trainmon consume --list``."""
    if argv and not argv[0].startswith("-"):
        name, rest = argv[0], argv[1:]
        if name not in registry.BY_NAME:
            print(f"trainmon consume: no consumer {name!r}; there are: {', '.join(CONSUMERS)} "
                  "(trainmon consume --list says what each does)", file=sys.stderr)
            return 2
        consumer = registry.BY_NAME[name]
        return _call(consumer.main, consumer.extra, rest, streaming=True)
    parser = argparse.ArgumentParser(
        prog="trainmon consume", usage="trainmon consume NAME [its options] | --list",
        description="Run a consumer service: its own Kafka consumer group turning the record "
                    "topics into a view. 'trainmon consume NAME --help' shows NAME's options.",
        epilog="consumers:\n" + registry.listing(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the consumers and what each does")
    args = parser.parse_args(argv)
    if not args.list:
        parser.print_help()
        return 2
    print(registry.listing())
    return 0


def cmd_schema(args) -> int:
    from .schemas import json_schemas

    schemas = json_schemas()
    if args.kind:
        if args.kind not in schemas:
            print(f"unknown record kind {args.kind!r}; known: {', '.join(schemas)}", file=sys.stderr)
            return 2
        schemas = {args.kind: schemas[args.kind]}
    print(json.dumps(schemas, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainmon", description="trainmon: training-run metrics through Kafka into ClickHouse, "
        "W&B / Aim / TensorBoard and alert rules.",
        epilog="Start here: 'trainmon up', then run your job with the line it prints.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("schema", help="print the JSON Schema of each record type")
    p.add_argument("kind", nargs="?")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("broker", help="fetch, start, stop the local Kafka broker (KRaft)")
    p.add_argument("action", choices=["fetch", "start", "stop", "status"])
    p.add_argument("--data-dir", type=Path, default=_default_broker_dir())
    p.add_argument("--port", type=int, default=None,
                   help="default: $TRAINMON_BROKER_PORT, the data directory's broker's, else 9092")
    p.add_argument("--heap", default="512m")
    p.add_argument("--nodes", type=int, default=1, choices=(1, 3),
                   help="1, or 3 brokers (controller voters) that replicate every topic")
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("consume", add_help=False,
                       help=f"run a consumer service: {', '.join(CONSUMERS)} (--list says what each does)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: consume_main(a.rest))

    for action, text in STACK_ACTIONS.items():
        sub.add_parser(action, help=text)

    for name, (target, extra, text) in DELEGATED.items():
        p = sub.add_parser(name, add_help=False, help=text)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda a, t=target, e=extra: _call(t, e, a.rest))
    return parser


STACK_ACTIONS = {"up": "start Kafka and the supervised consumers on this machine; prints the job's env line",
                 "status": "the one-machine stack: Kafka, the supervisor, each service with uptime, restarts, lag",
                 "logs": "a service's log from the one-machine stack",
                 "down": "stop the one-machine stack"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in STACK_ACTIONS:
        from .stack import main as stack_main

        return stack_main(argv)
    if argv and argv[0] == "consume":
        return consume_main(argv[1:])
    if argv and argv[0] in DELEGATED:
        # Straight through: argparse's REMAINDER drops leading options ("sql --path P ...").
        target, extra, _ = DELEGATED[argv[0]]
        return _call(target, extra, argv[1:], streaming=argv[0] in ("replay", "ingest"))
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
