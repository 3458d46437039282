"""``trainmon roundtrip``: a short producer -> Kafka -> consumer round trip that prints
what arrived. It starts a throwaway local broker unless TRAINMON_KAFKA_BOOTSTRAP is set."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
import uuid
from collections import Counter

from . import topics
from .broker import Broker
from .consumers.stream import RecordStream
from .kafka_client import settings as kafka_settings
from .producer import Producer, ProducerConfig


@contextlib.contextmanager
def _bootstrap(tmp: str):
    if os.environ.get("TRAINMON_KAFKA_BOOTSTRAP"):
        yield os.environ["TRAINMON_KAFKA_BOOTSTRAP"]
        return
    print("starting a local Kafka broker (KRaft) ...", flush=True)
    broker = Broker(os.path.join(tmp, "kafka"), throwaway=True).start()  # gone with this process
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainmon roundtrip", description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    run_id = f"roundtrip-{uuid.uuid4().hex[:6]}"
    prefix = f"rt{uuid.uuid4().hex[:6]}."
    # A stack's broker (TRAINMON_KAFKA_BOOTSTRAP) may want its SASL / TLS settings, the
    # TRAINMON_KAFKA_* variables `trainmon up` printed; the throwaway broker wants none.
    security = kafka_settings.security_from(os.environ) if os.environ.get("TRAINMON_KAFKA_BOOTSTRAP") else {}
    with tempfile.TemporaryDirectory(prefix="trainmon-") as tmp, _bootstrap(tmp) as bootstrap:
        sent = 0
        for rank in range(args.ranks):
            with Producer(ProducerConfig(bootstrap=bootstrap, run_id=run_id, rank=rank,
                                         world_size=args.ranks, topic_prefix=prefix, kafka=security,
                                         spill_dir=os.path.join(tmp, "spill"))) as producer:
                producer.run_start(config={"lr": 3e-4})
                for step in range(args.steps):
                    loss = math.nan if (rank, step) == (1, 3) else 3.0 / (step + 1)
                    producer.log_step(step, step_tokens=4096, duration_ms=100.0 + rank, loss=loss,
                                      norm=0.5, lr=3e-4, total_steps=args.steps)
                producer.log_eval(args.steps, eval_tokens=1024, duration_ms=50.0, loss=1.1)
                producer.run_end("success")
                sent += args.steps + 3
        print(f"logged {sent} records from {args.ranks} ranks of run {run_id}")

        stream = RecordStream(f"roundtrip-{uuid.uuid4().hex[:6]}", topic_prefix=prefix,
                              env={**security, "TRAINMON_KAFKA_BOOTSTRAP": bootstrap})
        received, deadline = [], time.monotonic() + 30
        while len(received) < sent and time.monotonic() < deadline:
            received.extend(stream.poll(timeout_ms=500))
        stream.close()
        print(f"received {len(received)} records:")
        for kind, count in sorted(Counter(m.kind for m in received).items()):
            print(f"  {topics.topic_for(kind, prefix):<24} {count}")
        for m in sorted((m for m in received if m.kind == "step"),
                        key=lambda m: (m.record.rank, m.record.step)):
            r = m.record
            print(f"  rank {r.rank} step {r.step}: loss {r.loss:.4f} norm {r.norm:.2f} "
                  f"{r.tokens_per_second:,.0f} tok/s  (event {r.event_id})")
        return 0 if len(received) == sent else 1
