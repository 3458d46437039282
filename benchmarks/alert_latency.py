"""Alert detection latency (log call -> alert event on the topic) and rules throughput.

1. Engine alone: records/s through ``AlertEngine.process`` (synthetic 64-rank run: step,
   GPU and MoE records), no Kafka.
2. Through Kafka: the same records produced to the topics first, then the alert service
   reads them; records/s from its first record to its last.
3. Latency: the service runs live while 8 ranks log steps through the producer at
   ``--rate`` steps/s each; every ``--every``-th step has a NaN loss. Latency is the
   arrival of the firing alert on the alert topic minus the alert's record time, which is
   the time of the ``log_step`` call that carried the NaN (same clock). Target p99 <= 2 s.
4. Delivered: ``trainmon consume notify`` runs beside the service with a json:// URL to
   a local webhook server; latency is the message's arrival there minus the same log
   call's time. Target p99 <= 2 s.

    .venv/bin/python benchmarks/alert_latency.py [--injections 60] [--records 100000]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import broker_bootstrap, percentile  # noqa: E402

from trainmon.kafka_client import Consumer, TopicPartition  # noqa: E402

from trainmon import topics  # noqa: E402
from trainmon.consumers.alerts import RULE_CLASSES, AlertEngine, load_config  # noqa: E402
from trainmon.consumers.alerts.service import AlertService  # noqa: E402
from trainmon.consumers import serving  # noqa: E402
from trainmon.consumers.notify.config import load_config as notify_config  # noqa: E402
from trainmon.consumers.notify.sink import NotifySink  # noqa: E402
from trainmon.producer import Producer, ProducerConfig  # noqa: E402
from trainmon.schemas import GpuRecord, MoeRecord, StepRecord, decode  # noqa: E402

UTC = timezone.utc


def synthetic_records(n: int, ranks: int = 64) -> list:
    """A healthy run, ``ranks`` ranks in lockstep, one step per second of record time."""
    rng = random.Random(0)
    t0 = time.time() - 3600
    out = []
    step = 0
    while len(out) < n:
        t = datetime.fromtimestamp(t0 + step, UTC)
        for r in range(ranks):
            env = dict(run_id="bench", rank=r, world_size=ranks, host=f"node{r // 8}", time=t)
            out.append(StepRecord(**env, event_id=f"s{r}-{step}", step=step, epoch=0.0, step_tokens=4096,
                                  duration_ms=1000 * (1 + 0.02 * rng.random()),
                                  loss=2 + math.exp(-step / 500) + 0.01 * rng.random(),
                                  norm=1 + 0.05 * rng.random(), lr=3e-4, loss_scale=65536.0,
                                  num_zeros=10, num_params=1_000_000))
            out.append(GpuRecord(**env, event_id=f"g{r}-{step}", step=step, id=r % 8, clock=1980,
                                 max_clock=1980, power=500_000, power_limit=700_000, temperature=65,
                                 temp_slowdown=90, gpu_util=97, mem_util=60, dram_free=20 << 30,
                                 pcie_rx=0, pcie_tx=0, fan=0))
            out.append(MoeRecord(**env, event_id=f"m{r}-{step}", step=step, aux_loss=0.01, z_loss=0.001,
                                 expert_utilization=0.95, load_imbalance=1.3))
        step += 1
    return out[:n]


def engine_throughput(records: list) -> float:
    engine = AlertEngine(load_config(env={}))
    started = time.perf_counter()
    for i, record in enumerate(records):
        engine.process(record)
        if i % 5000 == 0:
            engine.tick()
    return len(records) / (time.perf_counter() - started)


def kafka_throughput(bootstrap: str, records: list, state_dir: Path) -> float:
    prefix = f"bench{uuid.uuid4().hex[:6]}."
    producer = Producer(ProducerConfig(bootstrap=bootstrap, topic_prefix=prefix, run_id="bench",
                                       spill_dir=state_dir / "spill", queue_size=len(records) + 10))
    for record in records:
        producer.send_record(record)
    assert producer.flush(120), "records did not reach Kafka"
    producer.close()
    env = {"TRAINMON_KAFKA_BOOTSTRAP": bootstrap}
    service = AlertService(load_config(env={**env, "TRAINMON_ALERT_STATE_DIR": str(state_dir)}),
                           topic_prefix=prefix, env=env)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    first = last = None
    while last is None:
        done = service.stats["records"]
        now = time.perf_counter()
        if done and first is None:
            first = now
        if done >= len(records):
            last = now
        time.sleep(0.01)
    service.shutdown.set()
    thread.join(60)
    return len(records) / (last - first)


class Webhook:
    """A local webhook server: when each message arrived, and the event ids it carried."""

    def __init__(self):
        self.arrivals: list[tuple[float, list[str]]] = []
        arrivals = self.arrivals

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                now = time.time()
                events = [line.removeprefix("events: ").split() for line in body["message"].splitlines()
                          if line.startswith("events: ")]
                arrivals.append((now, events[0] if events else []))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"json://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def latency(bootstrap: str, state_dir: Path, injections: int, every: int, rate: float,
            ranks: int) -> tuple[list[float], list[float]]:
    """Per NaN injection: log call -> firing alert on the topic, and log call -> its
    message at the webhook server (each sorted)."""
    prefix = f"lat{uuid.uuid4().hex[:6]}."
    # A group of its own: the throughput stage's service, in the default group, left it
    # holding a static member's assignment of other topics (nothing arrived here).
    env = {"TRAINMON_KAFKA_BOOTSTRAP": bootstrap, "TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "0",
           "TRAINMON_ALERT_RATE_LIMIT_PER_MINUTE": "10000", "TRAINMON_ALERT_GROUP_ID": f"{prefix}alerts"}
    # Create the topics first so neither side waits on auto-creation during the run.
    warm = Producer(ProducerConfig(bootstrap=bootstrap, topic_prefix=prefix, run_id="warmup",
                                   spill_dir=state_dir / "spill"))
    for i in range(3):
        warm.log_step(i, step_tokens=1, duration_ms=1, loss=1.0, norm=1.0, lr=1e-4)
        warm.log_gpu_state(i, id=0, clock=1, max_clock=1, power=1, power_limit=1, temperature=1,
                           temp_slowdown=90, gpu_util=99, mem_util=1, dram_free=1 << 40, pcie_rx=0,
                           pcie_tx=0, fan=0)
        warm.log_moe_stats(i, aux_loss=0, z_loss=0, expert_utilization=1, load_imbalance=1)
    warm.run_end()
    warm.close()
    service = AlertService(load_config(env={**env, "TRAINMON_ALERT_STATE_DIR": str(state_dir)}),
                           topic_prefix=prefix, env=env)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    webhook = Webhook()
    notify_env = {"TRAINMON_NOTIFY": webhook.url, "TRAINMON_NOTIFY_STATE_DIR": str(state_dir / "notify"),
                  "TRAINMON_NOTIFY_RATE_PER_MIN": "10000"}  # one NaN every half second, on purpose
    notify_stop = threading.Event()
    notifier = threading.Thread(target=serving.serve, daemon=True, args=(
        NotifySink(notify_config(env=notify_env), topic_prefix=prefix),),
        kwargs=dict(topic_prefix=prefix, env=env, stop=notify_stop))
    notifier.start()
    arrivals: list[float] = []
    logged_at: dict[str, float] = {}  # firing event id -> its log call's time
    stop = threading.Event()

    def watch():
        topic = topics.topic_for("alert", prefix)
        consumer = Consumer(None, bootstrap=bootstrap)
        while not (parts := consumer.partitions_for(topic)) and not stop.wait(0.1):
            pass  # the alert topic appears with the service's first alert
        consumer.assign({TopicPartition(topic, p): 0 for p in parts})
        while not stop.is_set():
            messages = consumer.poll(0.1)
            now = time.time()
            for m in messages:
                alert = decode("alert", m.value)
                if alert.state == "firing" and alert.run_id == "lat":
                    arrivals.append(now - alert.time.timestamp())
                    logged_at[alert.event_id] = alert.time.timestamp()
        consumer.close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(5)  # the service has joined its group and caught up
    producers = [Producer(ProducerConfig(bootstrap=bootstrap, topic_prefix=prefix, run_id="lat", rank=r,
                                         world_size=ranks, spill_dir=state_dir / "spill")) for r in range(ranks)]
    step = 0
    next_at = time.perf_counter()
    while step < injections * every:
        for p in producers:
            loss = float("nan") if step % every == every - 1 else 2.0
            p.log_step(step, step_tokens=4096, duration_ms=1000 / rate, loss=loss, norm=1.0, lr=3e-4)
            p.log_gpu_state(step, id=0, clock=1980, max_clock=1980, power=500_000, power_limit=700_000,
                            temperature=65, temp_slowdown=90, gpu_util=97, mem_util=60, dram_free=20 << 30,
                            pcie_rx=0, pcie_tx=0, fan=0)
        step += 1
        next_at += 1 / rate
        time.sleep(max(0.0, next_at - time.perf_counter()))
    deadline = time.time() + 20

    def delivered() -> list[float]:
        return [at - logged_at[e] for at, events in list(webhook.arrivals) for e in events if e in logged_at]

    while (len(arrivals) < injections or len(delivered()) < injections) and time.time() < deadline:
        time.sleep(0.1)
    for p in producers:
        p.close()
    stop.set()
    service.shutdown.set()
    notify_stop.set()
    thread.join(60)
    watcher.join(10)
    notifier.join(30)
    webhook.server.shutdown()
    return sorted(arrivals), sorted(delivered())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--injections", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="a NaN every N steps")
    parser.add_argument("--rate", type=float, default=20.0, help="steps per second per rank")
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args()

    records = synthetic_records(args.records)
    print(f"rules engine alone: {engine_throughput(records):,.0f} records/s "
          f"({len(records):,} step/gpu/moe records, 64 ranks, {len(RULE_CLASSES)} rules)")
    with broker_bootstrap() as bootstrap, tempfile.TemporaryDirectory() as tmp:
        rate = kafka_throughput(bootstrap, records, Path(tmp) / "throughput")
        print(f"through Kafka (decode + rules + commit): {rate:,.0f} records/s")
        lat, delivered = latency(bootstrap, Path(tmp) / "latency", args.injections, args.every, args.rate,
                                 args.ranks)
        for what, values in (("detection latency, log call -> alert on the topic", lat),
                             ("delivery latency, log call -> message at a local webhook (trainmon consume "
                              "notify, json://)", delivered)):
            if not values:
                print(f"{what}: nothing arrived")
                continue
            print(f"{what} ({len(values)} of {args.injections} NaN injections, {args.ranks} ranks x "
                  f"{args.rate:g} steps/s): p50 {1000 * percentile(values, 50):.0f} ms, "
                  f"p99 {1000 * percentile(values, 99):.0f} ms, max {1000 * values[-1]:.0f} ms "
                  f"(target p99 <= 2000 ms: {'met' if percentile(values, 99) <= 2.0 else 'NOT met'})")


if __name__ == "__main__":
    main()
