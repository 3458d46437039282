"""The event log's disk budget: bytes per step record on the broker's disk, and per row in
ClickHouse.

Step records like the demo's (every rank, every step: loss, lr, tokens, timers, ...) are
sent as a training loop's producer sends them: uncompressed (producer.config's
default_compression for linger 0), with the schema header its transport puts on every
message, one message per pack window holding the records logged in it, one message per
request (each rank is a producer of its own, so the broker never sees two ranks' messages
in one batch). Three packings, each sent two ways:

- 1 step/s per rank: one record per message (the pack window is 0.5 s);
- 10 steps/s per rank: 5 records per message (a pack window's);
- 100 steps/s per rank: 50 records per message;
- and each through a node's relay (``trainmon relay``, its 50 ms window): the messages of
  all ``--ranks`` ranks of one pack window in one Kafka message, rank after rank, up to
  MAX_RECORDS_PER_MESSAGE (1 step/s: 8 records, one per rank; 10 steps/s: 40);
- and 1 step/s through a relay with a 3 s window (``--window-ms 3000``, not the default:
  3 s more latency): 24 records per message.

Each goes to topics under their own prefixes in one broker of this run: ``before`` (the
topic as trainmon made it until now: the producer's compression, i.e. none), the
broker-side compressions measured (zstd, lz4, gzip), and ``after``: the topic config
trainmon now creates (topics.topic_config). Bytes on disk are the log segments' sizes
(indexes aside). Then the ``after`` topic is replayed into a fresh chDB directory (the
real loader, ``trainmon replay``) and the step table's bytes on disk per row are read
from system.parts, after merging its parts. Target: <= 100 bytes per step record on the
broker's disk.

The records' loss and gradient norm are the step's, the same on every rank, as
data-parallel training logs them; ``--per-rank-values`` gives every rank its own (see
step_records).

    .venv/bin/python benchmarks/disk_budget.py [--ranks 8] [--steps 1000] [--per-rank-values]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import random
import sys
import tempfile
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainmon import topics  # noqa: E402
from trainmon.broker import Broker  # noqa: E402
from trainmon.kafka_client import Producer, create_topics  # noqa: E402
from trainmon.producer import ProducerConfig  # noqa: E402
from trainmon.relay.server import KAFKA_COMPRESSION  # noqa: E402
from trainmon.schemas import (MAX_RECORDS_PER_MESSAGE, SCHEMA_HEADER, StepRecord, encode, pack,  # noqa: E402
                              schema_fingerprint)

TARGET_BYTES = 100
# packing -> (records per rank per message, through a node relay)
PER_WINDOW = {rate: max(1, int(rate * ProducerConfig.pack_window_ms / 1000)) for rate in (1, 10, 100)}
PACKINGS = {"1 step/s": (PER_WINDOW[1], False), "10 steps/s": (PER_WINDOW[10], False),
            "100 steps/s": (PER_WINDOW[100], False), "1 step/s, relay": (PER_WINDOW[1], True),
            "10 steps/s, relay": (PER_WINDOW[10], True), "100 steps/s, relay": (PER_WINDOW[100], True),
            # trainmon relay --window-ms 3000: 3 s more latency, not the default
            "1 step/s, relay 3 s window": (3, True)}
BROKER_COMPRESSIONS = {"zstd": {"compression.type": "zstd"},
                       "lz4": {"compression.type": "lz4"}, "gzip": {"compression.type": "gzip"}}


def step_records(ranks: int, steps: int, per_rank_values: bool = False) -> list[list[StepRecord]]:
    """Per rank, its step records in order: values like the demo's training loop logs.

    Every rank has its own time, duration and timers. The loss and the gradient norm are
    the step's, the same on every rank, as data-parallel training logs them: the norm is
    the global one (all-reduced before clipping), and Megatron, torchtitan and the HF
    Trainer average the loss over the data-parallel ranks before they log it. With
    ``per_rank_values`` every rank draws its own loss and norm instead (what this
    benchmark measured until 2026-11-26: their random digits cost ~20 bytes a record more
    when the ranks' records share a message)."""
    rng = random.Random(7)
    run_id, t0 = f"disk-budget-{uuid.uuid4().hex[:6]}", datetime.now(timezone.utc)
    shared = [(2.0 + 8.0 * math.exp(-step / 500) + rng.gauss(0, 0.02), abs(rng.gauss(0.9, 0.1)))
              for step in range(1, steps + 1)]
    out = []
    for rank in range(ranks):
        prefix = uuid.uuid4().hex[:12]  # as the producer makes its ids (logger._new_id_prefix)
        records = []
        for step in range(1, steps + 1):
            duration = 800.0 + rng.gauss(0, 15)
            loss, norm = shared[step - 1]
            if per_rank_values:
                loss, norm = 2.0 + 8.0 * math.exp(-step / 500) + rng.gauss(0, 0.02), abs(rng.gauss(0.9, 0.1))
            records.append(StepRecord(
                run_id=run_id, rank=rank, world_size=ranks, host=f"node{rank // 8:03d}",
                time=t0 + timedelta(milliseconds=step * duration), event_id=f"{prefix}-{step}",
                step=step, epoch=step / steps, step_tokens=524288, duration_ms=duration,
                loss=loss, norm=norm, lr=3e-4 * min(1.0, step / 100), total_steps=steps, skipped=0,
                consumed_samples=step * 256, global_batch_size=256,
                timers={"forward-backward": duration * 0.9, "optimizer": duration * 0.1}))
        out.append(records)
    return out


def messages(per_rank: list[list[StepRecord]], per_message: int, relay: bool) -> list[list[StepRecord]]:
    """The records of each Kafka message: a rank's pack window alone, or through a relay
    every rank's window of the same steps together (up to MAX_RECORDS_PER_MESSAGE)."""
    windows = [[records[i:i + per_message] for i in range(0, len(records), per_message)] for records in per_rank]
    if not relay:
        return [window for rank in windows for window in rank]
    out = []
    for together in zip(*windows):
        merged = [record for window in together for record in window]
        out += [merged[i:i + MAX_RECORDS_PER_MESSAGE] for i in range(0, len(merged), MAX_RECORDS_PER_MESSAGE)]
    return out


def send(bootstrap: str, topic: str, per_rank: list[list[StepRecord]], per_message: int, relay: bool) -> int:
    """As the ranks' producers send them (uncompressed, one message per request), or their
    node's relay (zstd, as trainmon/relay/server.py sends)."""
    compression = KAFKA_COMPRESSION if relay else {"compression.type": "none"}
    producer = Producer(bootstrap=bootstrap, **compression, **{"linger.ms": 0, "batch.num.messages": 1})
    # The header the producer's transport puts on every message (schemas.SCHEMA_HEADER).
    headers = [(SCHEMA_HEADER, schema_fingerprint())]
    sent = 0
    key = per_rank[0][0].run_id.encode()
    for chunk in messages(per_rank, per_message, relay):
        producer.send(topic, pack([encode(r) for r in chunk]), key=key, headers=headers)
        sent += len(chunk)
    assert producer.flush(120), "Kafka did not take every message"
    return sent


def disk_bytes(broker: Broker, topic: str) -> int:
    """The topic's log segments on the broker's disk (all partitions)."""
    logs = broker.data_dir / "logs"
    return sum(f.stat().st_size for d in logs.glob(f"{topic}-*") for f in d.glob("*.log"))


def clickhouse_bytes_per_row(bootstrap: str, prefix: str, path: Path) -> tuple[float, int]:
    """Replay the prefix's topics into a fresh chDB directory; the step table's bytes on
    disk per row, once its parts are merged."""
    from trainmon.consumers.clickhouse.cli import replay_main
    from trainmon.consumers.clickhouse.client import Target, connect

    os.environ["TRAINMON_KAFKA_BOOTSTRAP"] = bootstrap
    with contextlib.redirect_stdout(io.StringIO()):
        assert replay_main(["--path", str(path), "--topic-prefix", prefix]) == 0
    client = connect(Target(path=path))
    try:
        client.command("OPTIMIZE TABLE trainmon.step FINAL")
        size, rows = client.query("SELECT sum(bytes_on_disk), sum(rows) FROM system.parts "
                                  "WHERE database = 'trainmon' AND table = 'step' AND active").result_rows[0]
    finally:
        client.close()
    return size / rows, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--per-rank-values", action="store_true",
                        help="every rank logs its own loss and gradient norm (see step_records)")
    args = parser.parse_args()
    per_rank = step_records(args.ranks, args.steps, args.per_rank_values)
    records = args.ranks * args.steps
    raw = sum(len(encode(r)) for rs in per_rank for r in rs) / records
    after = topics.topic_config("step")
    values = "each rank its own" if args.per_rank_values else "the step's, on every rank"
    print(f"{records:,} step records ({args.ranks} ranks x {args.steps} steps; loss and norm: {values}), "
          f"{raw:.0f} bytes each as JSON; the new default topic config: {after}")
    with tempfile.TemporaryDirectory(prefix="trainmon-disk-") as tmp:
        broker = Broker(Path(tmp) / "kafka", heap="1g", throwaway=True).start()
        try:
            configs = {"before (as sent: uncompressed)": {"compression.type": "producer", "retention.ms": "-1"},
                       **{f"broker {name}": config for name, config in BROKER_COMPRESSIONS.items()},
                       "after (the new default)": after}
            results: dict[tuple[str, str], float] = {}
            after_prefix = None
            for packing, (per_message, relay) in PACKINGS.items():
                shown = min(MAX_RECORDS_PER_MESSAGE, per_message * args.ranks) if relay else per_message
                print(f"\n{packing} per rank: {shown} record(s) per message")
                for name, config in configs.items():
                    prefix = f"disk{uuid.uuid4().hex[:6]}."
                    topic = topics.topic_for("step", prefix)
                    create_topics([topic], 1, bootstrap=broker.bootstrap, config=config)
                    sent = send(broker.bootstrap, topic, per_rank, per_message, relay)
                    results[packing, name] = per_record = disk_bytes(broker, topic) / sent
                    print(f"  {name:<32} {per_record:7.1f} bytes per step record on the broker's disk")
                    if name.startswith("after") and per_message == 1 and not relay:
                        after_prefix = prefix
            per_row, rows = clickhouse_bytes_per_row(broker.bootstrap, after_prefix, Path(tmp) / "chdb")
        finally:
            broker.stop()
    print(f"\nClickHouse: {per_row:.1f} bytes per step row on disk ({rows:,} rows, merged)")
    print(f"\ntarget: <= {TARGET_BYTES} bytes per step record on the broker's disk")
    for packing in PACKINGS:
        before, now = results[packing, "before (as sent: uncompressed)"], results[packing, "after (the new default)"]
        print(f"  {packing:<20} before {before:6.1f}, after {now:6.1f} ({before / now:.1f}x less): "
              f"{'met' if now <= TARGET_BYTES else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
