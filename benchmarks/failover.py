"""Broker failure without an outage: a broker of a 3-node cluster killed with -9, measured.

    .venv/bin/python benchmarks/failover.py [--outage 60] [--settle 20] [--reference 60]
    .venv/bin/python benchmarks/failover.py --outage 15 --settle 5 --kills leader --reference 0  # quick try

Everything is real and local: a Kafka cluster of its own (``trainmon.broker.Cluster``: three
KRaft nodes on loopback, each broker and controller voter; record topics with replication
factor 3, ``min.insync.replicas`` 2, no unclean leader election, brokers fenced 4 s after
their last heartbeat), the ClickHouse service as its own process (``python -m trainmon
consume clickhouse`` with ``TRAINMON_KAFKA_BOOTSTRAP`` the three brokers, otherwise its
default settings) and four producer processes, ranks 0-3 of one run, logging step records
at 50 steps/s through the public Producer API (benchmarks/outage_scenarios.py's, which
time every ``log_step`` call and watch Kafka's acknowledgements through the transport's
``on_ack`` hook).

1. Reference: the same four ranks on the same cluster and service for ``--reference`` s
   (60) with no kill: ``log_step`` p99 and max, the longest gap between acknowledgements,
   every record in ClickHouse.
2. Failover: a new run of four ranks logs for ``--settle`` s (20), then for each of
   ``--kills`` (``leader,controller``):
   - ``leader``: the broker that leads most record-topic partitions is killed with -9 (its
     JVM's process group). The run's id is chosen so that its partition of the step topic
     (one key per run) is led by that broker: the kill hits the ranks' own partition.
   - ``controller``: the active KRaft controller, read from the quorum's state
     (``__cluster_metadata-0/quorum-state``, the highest epoch's leader; DescribeCluster
     names some live broker under KRaft, not the controller).
   The broker is started again after ``--outage`` s (60) on its data dir and ports;
   then the run waits until it is back in the ISR of every partition it replicates, and
   logs ``--settle`` s more before the next kill (or closing).
   Measured per kill: the longest gap between two acknowledgements of any rank around the
   kill (each rank's acknowledgements are watched; gaps under 0.5 s are not recorded);
   time from the kill until ClickHouse holds the first record logged after the kill (the
   consumers loading again, the service never restarted: an exit on its own would be
   restarted and is reported); time from the restart until the broker is back in every
   ISR. Over the whole run: records logged vs distinct event ids in ClickHouse, rows
   without FINAL - distinct ids (duplicates: the producer is not idempotent, a resend can
   store a record twice in Kafka; ClickHouse keeps it once by event id, and a background
   merge may already have collapsed some: a lower bound), ``log_step`` p99 and max.

Targets: records in ClickHouse == logged; duplicates 0; ``log_step`` p99 <= 1 ms, max <=
50 ms over the whole run; the longest delivery gap after each kill <= 10 s; consumers
loading again within 15 s of each kill (outage_scenarios' consumer target). The reference's
figures are printed beside. Every process and temp dir is cleaned up and the whole run has
a deadline. Defaults take about 7 minutes. tests/test_failover.py runs a shorter one.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import json
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from outage_scenarios import (CATCH_UP_S, CLOSE_TIMEOUT_S, CONSUMER_TARGET_S, RANKS, RATE,  # noqa: E402
                              Producers, Service, deadline, ms, pause, row, verdict, wait_caught_up)

from _common import percentile  # noqa: E402
from trainmon import topics  # noqa: E402
from trainmon.broker import Cluster  # noqa: E402
from trainmon.kafka_client.admin import cluster_state  # noqa: E402
from trainmon.schemas import RECORD_TYPES  # noqa: E402

GAP_S = 0.6                # acknowledgement gaps recorded from this long (the pack window is 0.5 s)
P99_TARGET_MS = 1.0
MAX_TARGET_MS = 50.0
GAP_TARGET_S = 10.0
ISR_TIMEOUT_S = 180.0
KILLS = ("leader", "controller")


# -- the cluster -----------------------------------------------------------------------------

def record_topics(prefix: str) -> list[str]:
    return [topics.topic_for(kind, prefix) for kind in RECORD_TYPES]


def state(cluster: Cluster, names: list[str] | None = None) -> dict:
    return cluster_state(names, env=cluster.client_env(), bootstrap=cluster.bootstrap)


def active_controller(cluster: Cluster) -> int | None:
    """The active KRaft controller: the leader of the highest epoch any node's quorum
    state names (a node killed a while ago holds an older epoch)."""
    best: tuple[int, int] | None = None
    for broker in cluster.brokers:
        path = broker.data_dir / "logs" / "__cluster_metadata-0" / "quorum-state"
        with contextlib.suppress(OSError, ValueError):
            quorum = json.loads(path.read_text())
            if quorum.get("leaderId", -1) >= 0 and (best is None or quorum["leaderEpoch"] > best[0]):
                best = (quorum["leaderEpoch"], quorum["leaderId"])
    return None if best is None else best[1]


def partition_of(key: bytes, partitions: int) -> int:
    """The partition the producers' partitioner (murmur2, Java's) gives ``key``."""
    from kafka.partitioner.default import murmur2

    return (murmur2(key) & 0x7FFFFFFF) % partitions


def most_leading(st: dict) -> int:
    """The broker that leads most of the partitions in ``st`` (the lowest id of a tie)."""
    return max(sorted(b for b in st["leaders"] if b >= 0), key=lambda b: st["leaders"][b])


def run_led_by(broker_id: int, st: dict, topic: str, name: str) -> tuple[str, int]:
    """A run id whose partition of ``topic`` the broker leads, and that partition."""
    parts = sorted(p for (t, p) in st["partitions"] if t == topic)
    led = {p for p in parts if st["partitions"][(topic, p)]["leader"] == broker_id}
    if not led:
        raise RuntimeError(f"broker {broker_id} leads no partition of {topic}")
    while True:
        run_id = f"{name}-{uuid.uuid4().hex[:6]}"
        partition = partition_of(topics.record_key(run_id), len(parts))
        if partition in led:
            return run_id, partition


def out_of_isr(cluster: Cluster, node_id: int) -> int | None:
    """Partitions that have ``node_id`` as a replica but not in their ISR (None: the
    cluster did not answer)."""
    try:
        st = state(cluster)
    except Exception:  # a broker away or electing: ask again
        return None
    return sum(node_id in p["replicas"] and node_id not in p["isr"] for p in st["partitions"].values())


@contextlib.contextmanager
def cluster_pipeline(name: str):
    """A temp dir, a 3-node cluster with the topics, and the ClickHouse service reading it;
    all stopped and removed however the block ends. Yields (tmp, cluster, service, prefix)."""
    with tempfile.TemporaryDirectory(prefix=f"trainmon-{name}-") as tmp:
        tmp = Path(tmp)
        cluster = Cluster(tmp / "kafka", nodes=3)
        service = None
        try:
            cluster.start(timeout=180)
            prefix = f"{name}{uuid.uuid4().hex[:6]}."
            cluster.create_topics(topics.all_topics(prefix))
            service = Service(tmp, cluster.bootstrap, prefix)
            service.launch()
            service.sql("SELECT 1", timeout=120)
            yield tmp, cluster, service, prefix
        except BaseException:
            if service is not None:
                print(f"  ClickHouse service log (last lines):\n{service.tail()}", flush=True)
            for broker in cluster.brokers:
                with contextlib.suppress(OSError):
                    lines = (broker.data_dir / "broker.log").read_text(errors="replace").splitlines()
                    print(f"  broker {broker.node_id} log (last lines):\n" + "\n".join(lines[-8:]), flush=True)
            raise
        finally:
            if service is not None:
                service.stop()
            cluster.stop(kill=True)


# -- measuring -------------------------------------------------------------------------------

def first_logged_after(service: Service, run_id: str, wall: float) -> float | None:
    """Wall time ClickHouse inserted the first of the run's records logged after ``wall``."""
    n, first = service.sql(
        f"SELECT count(), toUnixTimestamp64Micro(min(_inserted_at)) FROM trainmon.step "
        f"WHERE run_id = '{run_id}' AND toUnixTimestamp64Micro(time) > {int(wall * 1e6)}")
    return int(first) / 1e6 if int(n) else None


def latencies(ranks: list[dict]) -> tuple[float, float]:
    """(p99, max) of every log_step call of every rank, in ms."""
    values: list[float] = []
    for r in ranks:
        durations = array.array("f")
        durations.frombytes(r["durations_us"])
        values.extend(durations)
    values.sort()
    return percentile(values, 99) / 1000, (values[-1] / 1000 if values else float("nan"))


def longest_gap(ranks: list[dict], since: float | None = None, until: float | None = None):
    """The longest time between two acknowledgements of one rank that overlaps
    [since, until] (the whole run when None), as (seconds, rank); (None, None) when no rank
    had a gap of GAP_S or more there."""
    best: tuple[float | None, int | None] = (None, None)
    for rank, r in enumerate(ranks):
        for start, end in r["gaps"]:
            if start is None or (since is not None and end <= since) or (until is not None and start >= until):
                continue
            if best[0] is None or end - start > best[0]:
                best = (end - start, rank)
    return best


def gap_text(gap: tuple[float | None, int | None]) -> str:
    return f"< {GAP_S} s" if gap[0] is None else f"{gap[0]:.1f} s (rank {gap[1]})"


def wait_loading(service: Service, run_id: str, since: float, timeout: float = 60.0) -> float | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        first = first_logged_after(service, run_id, since)
        if first is not None:
            return first - since
        time.sleep(0.2)
    return None


def totals(service: Service, run_id: str, ranks: list[dict]) -> dict:
    logged = sum(r["logged"] for r in ranks)
    distinct, rows, waited = wait_caught_up(service, run_id, logged, CATCH_UP_S)
    p99, worst = latencies(ranks)
    return {"logged": logged, "distinct": distinct, "rows": rows, "duplicates": rows - distinct,
            "waited": waited, "p99_ms": p99, "max_ms": worst,
            "raised": sum(r["raised"] for r in ranks), "dropped": sum(r["dropped"] for r in ranks),
            "spilled": sum(r["spilled"] for r in ranks),
            "closed_ok": sum(r["closed_ok"] for r in ranks), "ranks": len(ranks)}


# -- the scenarios ---------------------------------------------------------------------------

def reference(tmp: Path, cluster: Cluster, service: Service, prefix: str, seconds: float) -> dict:
    run_id = f"reference-{uuid.uuid4().hex[:6]}"
    (tmp / "reference").mkdir()
    producers = Producers(tmp / "reference", cluster.bootstrap, prefix, run_id, RANKS,
                          max_s=seconds + 120, gap_s=GAP_S)
    try:
        producers.start_logging()
        if wait_loading(service, run_id, 0.0, 120) is None:
            raise TimeoutError("the service loaded nothing of the reference run in 120 s")
        pause(seconds, service, producers)
        ranks = producers.finish()
    finally:
        producers.terminate()
    result = totals(service, run_id, ranks)
    result["gap"] = longest_gap(ranks)
    return result


def kill_and_return(which: str, cluster: Cluster, service: Service, producers: Producers,
                    run_id: str, step_topic: str, partition: int, prefix: str, outage_s: float) -> dict:
    st = state(cluster, record_topics(prefix))
    controller = active_controller(cluster)
    if which == "leader":
        node = most_leading(st)
    else:
        node = controller
    broker = next(b for b in cluster.brokers if b.node_id == node)
    kill = {"which": which, "node": node, "leads": st["leaders"].get(node, 0),
            "record_partitions": len(st["partitions"]), "controller": controller == node,
            "run_partition": st["partitions"][(step_topic, partition)]["leader"] == node}
    broker.stop(kill=True)
    kill["at"] = killed = time.time()
    loaded = None
    began = time.monotonic()
    while time.monotonic() - began < outage_s:
        if loaded is None:
            first = first_logged_after(service, run_id, killed)
            loaded = None if first is None else first - killed
        pause(min(0.5, max(0.0, outage_s - (time.monotonic() - began))), service, producers)
    kill["restarted_at"] = restarting = time.time()
    broker.start(timeout=120)
    kill["start_s"] = time.time() - restarting
    isr_deadline = time.monotonic() + ISR_TIMEOUT_S
    while out_of_isr(cluster, node) != 0:
        if time.monotonic() > isr_deadline:
            raise TimeoutError(f"broker {node} not back in every ISR {ISR_TIMEOUT_S:.0f} s after its restart")
        pause(0.5, service, producers)
    kill["isr_s"] = time.time() - restarting
    kill["loading_s"] = loaded if loaded is not None else wait_loading(service, run_id, killed, 60)
    return kill


def failover(tmp: Path, cluster: Cluster, service: Service, prefix: str, kills: tuple[str, ...],
             outage_s: float, settle_s: float) -> dict:
    step_topic = topics.topic_for("step", prefix)
    st = state(cluster, record_topics(prefix))
    first = most_leading(st)
    run_id, partition = run_led_by(first, st, step_topic, "failover")
    (tmp / "failover").mkdir()
    producers = Producers(tmp / "failover", cluster.bootstrap, prefix, run_id, RANKS,
                          max_s=len(kills) * (outage_s + ISR_TIMEOUT_S + 120 + settle_s) + settle_s + 300,
                          gap_s=GAP_S)
    done: list[dict] = []
    try:
        producers.start_logging()
        if wait_loading(service, run_id, 0.0, 120) is None:
            raise TimeoutError("the service loaded nothing of the run in 120 s")
        pause(settle_s, service, producers)
        for which in kills:
            done.append(kill_and_return(which, cluster, service, producers, run_id, step_topic,
                                        partition, prefix, outage_s))
            pause(settle_s, service, producers)
        ranks = producers.finish()
    finally:
        producers.terminate()
    result = totals(service, run_id, ranks)
    for i, kill in enumerate(done):
        until = done[i + 1]["at"] if i + 1 < len(done) else None
        kill["gap"] = longest_gap(ranks, kill["at"], until)
    result["kills"] = done
    result["run_partition"] = partition
    stored = service.sql(f"SELECT arrayStringConcat(groupUniqArray(toString(_partition)), ',') "
                         f"FROM trainmon.step WHERE run_id = '{run_id}'")[0].strip()
    result["stored_partitions"] = stored
    result["service_exits"] = list(service.exits)
    result["gap"] = longest_gap(ranks)
    return result


# -- reporting -------------------------------------------------------------------------------

def report(res: dict, ref: dict | None) -> None:
    def beside(value, ref_value) -> str:
        return value if ref is None else f"{value}  (reference: {ref_value})"

    print(f"\nfailover: {RANKS} ranks x {RATE:.0f} steps/s on 3 brokers", flush=True)
    row("the run's step partition (records stored from)",
        f"{res['run_partition']} ({res['stored_partitions'] or 'none'})")
    for i, k in enumerate(res["kills"], 1):
        role = (f"leads {k['leads']} of {k['record_partitions']} record partitions"
                + ("; the active controller" if k["controller"] else "")
                + ("; leads the run's partition" if k["run_partition"] else "; not the run's partition leader"))
        row(f"kill {i} ({k['which']}): broker", f"{k['node']} ({role})")
        row(f"kill {i}: longest gap in acknowledgements", gap_text(k["gap"]))
        row(f"kill {i}: consumers loading again (-> first new record)", ms(k["loading_s"]))
        row(f"kill {i}: restart -> back in every ISR", f"{ms(k['isr_s'])} (start() took {ms(k['start_s'])})")
    row("ClickHouse service exits on its own (restarted)", res["service_exits"] or "none")
    row("records logged (sum over ranks)", beside(f"{res['logged']:,}", ref and f"{ref['logged']:,}"))
    row("ClickHouse: distinct event ids",
        beside(f"{res['distinct']:,} (waited {res['waited']:.1f} s after close)", ref and f"{ref['distinct']:,}"))
    row("ClickHouse: rows without FINAL / duplicates",
        beside(f"{res['rows']:,} / {res['duplicates']:,}", ref and f"{ref['rows']:,} / {ref['duplicates']:,}"))
    row("log_step p99 / max", beside(f"{res['p99_ms']:.3f} ms / {res['max_ms']:.1f} ms",
                                     ref and f"{ref['p99_ms']:.3f} ms / {ref['max_ms']:.1f} ms"))
    row("longest gap in acknowledgements, whole run", beside(gap_text(res["gap"]), ref and gap_text(ref["gap"])))
    row("log calls raised / dropped / spill left at close",
        beside(f"{res['raised']} / {res['dropped']} / {res['spilled']}",
               ref and f"{ref['raised']} / {ref['dropped']} / {ref['spilled']}"))
    row("close() True", beside(f"{res['closed_ok']} of {res['ranks']}", ref and f"{ref['closed_ok']} of {ref['ranks']}"))


def targets(res: dict | None, ref: dict | None) -> dict[str, bool]:
    """Prints the targets, met or MISSED; returns them by name."""
    print("\ntargets", flush=True)
    got: dict[str, bool] = {}

    def target(name: str, ok: bool, figure: str, ref_figure: str | None = None) -> None:
        got[name] = ok
        row(name, f"{verdict(ok)} ({figure})" + (f"  (reference: {ref_figure})" if ref_figure else ""))

    if res is None:
        row("failover", "MISSED (the scenario failed)")
        return {"failover": False}
    target("records in ClickHouse == logged", res["distinct"] == res["logged"],
           f"{res['distinct']:,} of {res['logged']:,}", ref and f"{ref['distinct']:,} of {ref['logged']:,}")
    target("duplicates = 0", res["duplicates"] == 0, f"{res['duplicates']:,}", ref and f"{ref['duplicates']:,}")
    target(f"log_step p99 <= {P99_TARGET_MS:g} ms", res["p99_ms"] <= P99_TARGET_MS,
           f"{res['p99_ms']:.3f} ms", ref and f"{ref['p99_ms']:.3f} ms")
    target(f"log_step max <= {MAX_TARGET_MS:g} ms", res["max_ms"] <= MAX_TARGET_MS,
           f"{res['max_ms']:.1f} ms", ref and f"{ref['max_ms']:.1f} ms")
    for i, k in enumerate(res["kills"], 1):
        gap = k["gap"][0] or 0.0
        target(f"kill {i} ({k['which']}): delivery gap <= {GAP_TARGET_S:g} s", gap <= GAP_TARGET_S,
               gap_text(k["gap"]), ref and gap_text(ref["gap"]))
        loading = k["loading_s"]
        target(f"kill {i} ({k['which']}): consumers loading within {CONSUMER_TARGET_S:g} s",
               loading is not None and loading <= CONSUMER_TARGET_S and not res["service_exits"],
               ms(loading) + (f", service restarted {len(res['service_exits'])}x" if res["service_exits"] else ""))
    return got


# -- running ---------------------------------------------------------------------------------

def run(kills: tuple[str, ...] = KILLS, outage_s: float = 60.0, settle_s: float = 20.0,
        reference_s: float = 60.0) -> dict:
    """The reference (when ``reference_s``) and the failover run on one cluster; prints
    the figures and the targets; returns {"reference", "failover", "targets"}."""
    for which in kills:
        if which not in KILLS:
            raise ValueError(f"unknown kill {which!r}: one of {', '.join(KILLS)}")
    limit = (180 + 120 + (reference_s + 120 + CLOSE_TIMEOUT_S + CATCH_UP_S if reference_s else 0)
             + 120 + settle_s + len(kills) * (outage_s + 120 + ISR_TIMEOUT_S + 60 + settle_s)
             + CLOSE_TIMEOUT_S + CATCH_UP_S + 60)
    print(f"failover: 3 brokers (RF 3, min.insync.replicas 2), {RANKS} ranks x {RATE:.0f} steps/s, the "
          f"ClickHouse service running; kills: {', '.join(kills)} (kill -9, back after {outage_s:.0f} s); "
          f"{settle_s:.0f} s of logging before and after each; reference: "
          + (f"the same ranks, {reference_s:.0f} s, no kill" if reference_s else "none"), flush=True)
    ref = res = None
    with deadline(limit, "failover"), cluster_pipeline("failover") as (tmp, cluster, service, prefix):
        if reference_s:
            ref = reference(tmp, cluster, service, prefix, reference_s)
        res = failover(tmp, cluster, service, prefix, kills, outage_s, settle_s)
    report(res, ref)
    return {"reference": ref, "failover": res, "targets": targets(res, ref)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage", type=float, default=60.0, help="seconds each killed broker stays down (60)")
    parser.add_argument("--settle", type=float, default=20.0,
                        help="seconds of logging before the first kill and after each return (20)")
    parser.add_argument("--kills", default=",".join(KILLS),
                        help="which broker to kill, in order: leader, controller (default both)")
    parser.add_argument("--reference", type=float, default=60.0,
                        help="seconds of the no-kill reference run (60; 0 skips it)")
    args = parser.parse_args()
    # `timeout` and Ctrl-C end the run through the finally blocks: nothing left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kills = tuple(k.strip() for k in args.kills.split(",") if k.strip())
    try:
        run(kills, args.outage, args.settle, args.reference)
    except Exception as exc:
        print(f"  FAILED: {type(exc).__name__}: {exc}", flush=True)
        targets(None, None)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
