"""Synthetic training runs for the alert tests, and running the alert service on them.

A run is a list of pydantic records with explicit record times (one step per second), so
the rules' decisions do not depend on how fast the test machine is. ``mutate`` injects
an anomaly by editing a step's field dicts in place.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from trainmon.consumers.alerts.config import load_config
from trainmon.consumers.alerts.service import AlertService
from trainmon.schemas import (CheckpointRecord, DiskRecord, EvalRecord, GpuHealthRecord, GpuRecord,
                              LogEventRecord, MoeRecord, ProducerHealthRecord, Record, RunRecord,
                              StepRecord)

from .waiting import wait_until

UTC = timezone.utc
Mutate = Callable[[int, int, dict, dict, dict], None]  # step, rank, step/gpu/moe fields


def synthetic_run(run_id: str, *, t0: float, ranks: int = 1, steps: int = 80, dt: float = 1.0,
                  seed: int = 0, mutate: Mutate | None = None, end: bool | set[int] = True,
                  stop_rank_at: dict[int, int] | None = None, first_step: int = 0,
                  only_ranks: set[int] | None = None, eval_every: int = 0,
                  end_status: str = "success", end_reason: str | None = None,
                  health_every: int = 0, checkpoint_every: int = 0,
                  log_events: bool = False) -> list[Record]:
    """A healthy run: loss falling, grad norm ~1, steady step time, cool busy GPUs, a
    balanced MoE router. ``stop_rank_at`` {rank: last step} makes ranks go silent;
    ``first_step`` / ``only_ranks`` produce a later part of a run, for some ranks.
    ``eval_every``: an eval record every that many steps, its loss the step's plus 0.1 (a
    mutation sets it with ``step["eval_loss"]``); ``end_status`` / ``end_reason``: how the
    run ends. ``health_every``: a gpu_health, a disk and a producer_health record every that
    many steps (a mutation changes them through ``gpu["health"]`` / ``gpu["disk"]`` /
    ``gpu["producer"]``). ``checkpoint_every``:
    a 40 GiB checkpoint saved in about 20 s every that many steps (``gpu["checkpoint"]``;
    None: no save). ``log_events``: the routine NCCL warning a healthy job prints now and
    then (steps 3 and 40); a mutation adds its own through ``gpu["log_events"]``."""
    rng = random.Random(seed)
    stop_rank_at = stop_rank_at or {}
    out: list[Record] = []

    def env(rank: int, t: float, kind: str, step: int) -> dict:
        return dict(run_id=run_id, rank=rank, world_size=ranks, host=f"node{rank // 8}",
                    time=datetime.fromtimestamp(t, UTC), event_id=f"{run_key}-{kind}-{rank}-{step}")

    run_key = hashlib.sha1(run_id.encode()).hexdigest()[:12]
    members = [r for r in range(ranks) if only_ranks is None or r in only_ranks]
    if first_step == 0:
        out += [RunRecord(**env(r, t0, "start", 0), event="start") for r in members]
    for s in range(first_step, steps):
        t = t0 + (s + 1) * dt
        for r in members:
            if s > stop_rank_at.get(r, steps):
                continue
            step = dict(step=s, epoch=0.0, step_tokens=4096, duration_ms=1000.0 * (1 + 0.02 * rng.uniform(-1, 1)),
                        loss=2.0 + math.exp(-s / 40) + 0.002 * rng.uniform(-1, 1),
                        norm=1.0 + 0.05 * rng.uniform(-1, 1), lr=3e-4 * min(1.0, (s + 1) / 10),
                        loss_scale=65536.0, num_zeros=1000, num_params=1_000_000, total_steps=1000)
            gpu = dict(step=s, id=0, clock=1980, max_clock=1980, power=500_000, power_limit=700_000,
                       temperature=65, temp_slowdown=90, gpu_util=97, mem_util=60, dram_free=20 << 30,
                       pcie_rx=0, pcie_tx=0, fan=0, throttle="app_clocks" if s % 10 == 0 else "")
            moe = dict(step=s, aux_loss=0.01, z_loss=0.001, expert_utilization=0.95, load_imbalance=1.3)
            step["eval_loss"] = step["loss"] + 0.1
            gpu["health"] = dict(step=s, id=0, ecc_volatile_corrected=0, ecc_volatile_uncorrected=0,
                                 remapped_rows_pending=False, remapped_rows_failed=False, xids=[],
                                 pcie_replays=0)
            gpu["disk"] = dict(step=s, path="/ckpt", free_bytes=800 << 30, total_bytes=1 << 40,
                               used_bytes=(1 << 40) - (800 << 30))
            gpu["producer"] = dict(step=s, queued=0, in_flight=1, spilled=0, held_in_memory=0,
                                   sent=10 * s, dropped=0, rejected=0, spill_errors=0, last_sent_age_s=0.4)
            gpu["checkpoint"] = dict(step=s, path=f"/ckpt/iter_{s:07d}", bytes=40 << 30,
                                     duration_ms=20_000.0 * (1 + 0.1 * rng.uniform(-1, 1)))
            routine = dict(level="warning", source="nccl", signature="NCCL WARN NET/IB : # : Got async event : port active",
                           text="NCCL WARN NET/IB : mlx5_0:1 Got async event : port active")
            gpu["log_events"] = ([dict(routine, count=1 if s == 3 else 2, first_step=3, last_step=s)]
                                 if log_events and s in (3, 40) else [])
            if mutate is not None:
                mutate(s, r, step, gpu, moe)
            eval_loss = step.pop("eval_loss")
            health, disk, producer = gpu.pop("health"), gpu.pop("disk"), gpu.pop("producer")
            checkpoint, events = gpu.pop("checkpoint"), gpu.pop("log_events")
            if health_every and s % health_every == 0:
                out.append(GpuHealthRecord(**env(r, t, "gpu_health", s), **health))
                out.append(DiskRecord(**env(r, t, "disk", s), **disk))
                out.append(ProducerHealthRecord(**env(r, t, "producer_health", s), **producer))
            out.append(StepRecord(**env(r, t, "step", s), **step))
            out.append(GpuRecord(**env(r, t, "gpu", s), **gpu))
            out.append(MoeRecord(**env(r, t, "moe", s), **moe))
            if checkpoint_every and s % checkpoint_every == 0 and s > 0 and checkpoint is not None:
                out.append(CheckpointRecord(**env(r, t, "checkpoint", s), **checkpoint))
            for i, event in enumerate(events):
                out.append(LogEventRecord(**env(r, t, f"log_event{i}", s), **event))
            if eval_every and s % eval_every == 0 and s > 0:
                out.append(EvalRecord(**env(r, t, "eval", s), step=s, eval_tokens=65536,
                                      duration_ms=500.0, loss=eval_loss))
    if end:
        t_end = t0 + (steps + 1) * dt
        ending = members if end is True else sorted(end)
        out += [RunRecord(**env(r, t_end, "end", steps), event="end", status=end_status,
                          reason=end_reason) for r in ending]
    return out


def process_records(engine, records: list[Record]) -> list:
    """Every alert ``engine.process`` gives for ``records``, without a tick: what the
    record-driven rules decide alone (the tick rules never look)."""
    out = []
    for record in records:
        out.extend(engine.process(record))
    return out


def run_engine(engine, records: list[Record], *, tick_after_s: float | None = None) -> list:
    """Every alert of ``records`` through an in-memory engine: per record, then a tick on
    record time; with ``tick_after_s``, one more tick with the wall clock that long after
    the last record (the job silent since)."""
    out = []
    for record in records:
        out.extend(engine.process(record))
        out.extend(engine.tick())
    if tick_after_s is not None and records:
        out.extend(engine.tick(now=max(r.time.timestamp() for r in records) + tick_after_s))
    return out


def engine_with(**settings):
    """An AlertEngine with TRAINMON_ALERT_* overrides (upper-cased keys)."""
    from trainmon.consumers.alerts import AlertEngine

    return AlertEngine(load_config(env={f"TRAINMON_ALERT_{k.upper()}": str(v) for k, v in settings.items()}))


def firing(alerts: list) -> list:
    return [a for a in alerts if a.state == "firing"]


def send(producer, records: list[Record]) -> None:
    for record in records:
        producer.send_record(record)
    assert producer.flush(30), "records did not reach Kafka"


def service_env(bootstrap: str, **alert_settings) -> dict:
    """Kafka settings plus TRAINMON_ALERT_* overrides, the way an operator would set them."""
    env = {"TRAINMON_KAFKA_BOOTSTRAP": bootstrap}
    env.update({f"TRAINMON_ALERT_{k.upper()}": str(v) for k, v in alert_settings.items()})
    return env


def make_service(env: dict, prefix: str, state_dir: Path) -> AlertService:
    # A group of its own per test (per topic prefix): a static member rejoining a group
    # under the same instance id gets its previous assignment back, another test's topics.
    config = load_config(env={"TRAINMON_ALERT_GROUP_ID": f"{prefix}alerts", **env,
                              "TRAINMON_ALERT_STATE_DIR": str(state_dir)})
    return AlertService(config, topic_prefix=prefix, env=env)


def run_until_idle(env: dict, prefix: str, state_dir: Path, idle_s: float = 0.5) -> AlertService:
    # (The service exits only once it has read every partition to its end, then quiet
    # this long: idle_s is no guess at how long Kafka takes.)
    service = make_service(env, prefix, state_dir)
    service.run(exit_when_idle_s=idle_s)
    return service


class BackgroundService:
    """The alert service in a thread, for tests that produce while it runs."""

    def __init__(self, env: dict, prefix: str, state_dir: Path):
        self.service = make_service(env, prefix, state_dir)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self.service.run()
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def __enter__(self) -> "BackgroundService":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> str:
        """What the service has seen, for a failure message."""
        engine = self.service.engine
        runs = {r.run_id: {"max_step": r.max_step, "clock": r.clock,
                           "ranks": {rs.rank: rs.last_step for rs in r.ranks.values()}}
                for r in list(engine.runs.values())}
        return f"stats={self.service.stats} ticks={self.service.ticks} runs={runs} error={self.error!r}"

    def stop(self) -> None:
        self.service.shutdown.set()
        self._thread.join(timeout=60)
        if self.error is not None:
            raise self.error


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "condition",
             details: Callable[[], str] | None = None) -> None:
    # Looks every 0.2 s: the service runs in this process, and polling it faster takes
    # the GIL from it.
    wait_until(predicate, timeout, what, pause=0.2, details=details)


def t0_now(steps: int = 80, dt: float = 1.0) -> float:
    """A start time such that a run of ``steps`` ends about now."""
    return time.time() - (steps + 1) * dt


def past_t0(seconds_ago: float = 900.0) -> float:
    return time.time() - seconds_ago


def failed_run_alerts(ranks: int, t0: float = 1.7e9):
    """A run of ``ranks`` ranks ending failed, each rank with its own reason (NCCL's
    watchdog names the rank and how long the collective ran): the run_failed alerts."""
    def at(s):
        return datetime.fromtimestamp(t0 + s, UTC)

    records = [RunRecord(run_id="huge", rank=r, world_size=ranks, host=f"node{r // 8}", event="start",
                         time=at(0), event_id=f"start-{r}") for r in range(ranks)]
    records += [RunRecord(run_id="huge", rank=r, world_size=ranks, host=f"node{r // 8}", event="end",
                          status="failed", time=at(10), event_id=f"end-{r}",
                          reason=f"[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL("
                                 f"SeqNum=4242, OpType=ALLREDUCE, NumelIn=262144, NumelOut=262144, "
                                 f"Timeout(ms)=600000) ran for {600000 + r} milliseconds before timing out.")
                for r in range(ranks)]
    engine = engine_with()
    out = []
    for record in records:
        out += engine.process(record)
    out += engine.tick()
    return [a for a in out if a.rule == "run_failed"]
