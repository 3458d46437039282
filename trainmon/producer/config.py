"""Producer settings from environment variables, so a training job needs no setup code."""

from __future__ import annotations

import hashlib
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path

from .. import topics
from ..kafka_client import settings as kafka_settings
from ..kafka_client.transport_choice import choose_client


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _seconds(value: str | None, default: float) -> float:
    try:
        seconds = float(value) if value else default
    except ValueError:
        return default
    # inf / nan: no interval (an Event.wait(inf) raises, and int(inf) for the pack window)
    return seconds if math.isfinite(seconds) else default


def default_run_id(env) -> str:
    """All ranks of one torchrun job share a run id without any coordination."""
    for var in ("TRAINMON_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if env.get(var) and env.get(var) != "none":
            return env[var]
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        # torchrun without --rdzv-id says "none"; the rendezvous endpoint and the day are
        # what all ranks of the job share. Set TRAINMON_RUN_ID to choose the name.
        seed = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}:{time.strftime('%Y%m%d', time.gmtime())}"
        return f"torchrun-{hashlib.sha1(seed.encode()).hexdigest()[:12]}"
    return f"run-{uuid.uuid4().hex[:12]}"


def default_job_id(env) -> str | None:
    """The job every run of one training job shares across restarts: TRAINMON_JOB_ID, else
    Slurm's job id (kept by a requeued job), else torchrun's rendezvous id (kept across its
    restarts). None: the run is a job of its own."""
    for var in ("TRAINMON_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if env.get(var) and env.get(var) != "none":
            return env[var]
    return None


# ProducerConfig.compression: chosen by default_compression from how the producer sends.
AUTO_COMPRESSION = "auto"


def default_compression(linger_ms: int = 0) -> str | None:
    """None for a training loop (``linger_ms`` 0), whose messages hold the few records of
    one pack window: lz4 barely shrinks them, while setting up its frame for each message
    (a fresh hash table and output buffer) cost librdkafka's thread ~60 µs of CPU per
    message with cold caches, measured at 1 step/s (benchmarks/producer_overhead.py).
    A bulk source packs hundreds of records per message: lz4 where its module is installed
    (a dependency of trainmon), else gzip, which kafka-python always has (at level 9, about
    ten times the CPU)."""
    if not linger_ms:
        return None
    try:
        import lz4.frame  # noqa: F401
    except ImportError:
        return "gzip"
    return "lz4"


@dataclass
class ProducerConfig:
    bootstrap: str = kafka_settings.DEFAULT_BOOTSTRAP
    run_id: str = ""
    job_id: str | None = None  # carried by the run start record
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    host: str = field(default_factory=socket.gethostname)
    topic_prefix: str = topics.DEFAULT_PREFIX
    # TRAINMON_KAFKA_* security settings (SASL / SSL), by env var name: see kafka_client.settings
    kafka: dict = field(default_factory=dict)
    client: str = field(default_factory=choose_client)  # confluent-kafka, or kafka-python
    # The node's relay's socket (TRAINMON_RELAY, see trainmon.relay): send through it
    # instead of a Kafka client of this process's own.
    relay: str | None = None
    max_message_bytes: int = 1_000_000  # one Kafka message at most (the broker's default limit)
    strict: bool = False
    enabled: bool = True
    log_file: str | None = None
    console: bool = False
    spill_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "trainmon" / "spill")
    queue_size: int = 100_000
    yield_to_caller: bool = True  # False for a bulk source: see Worker
    # How long the sender thread waits, once woken by a record, for more to pack with it.
    # 0 for a training loop (at 1-10 steps/s a wait is one more wake-up per step); a bulk
    # source (trainmon ingest) packs far more per message with a few ms.
    linger_ms: int = 0
    # While records come faster than this, the sender thread sends one message per window
    # rather than one per record (see Worker): the added latency is at most the window,
    # and only while the loop logs more often than once per window; a window ends early
    # once it holds a full message (500 records). Below 1 s, so that a loop at 1 step/s
    # still sends each record from its log call. A record's log call -> row latency is at
    # most this plus the ClickHouse service's --batch-ms (300) plus the insert: 0.5 s
    # keeps that under a second; 0.8 s made it 1.3 s at p99 for a 16-rank job logging
    # 5,000 records/s (benchmarks/pipeline_throughput.py). The cost is CPU at 2-10 steps/s,
    # a message per window: at 10 steps/s the process took 333 µs per step against 290
    # with 0.8 s and 437 with 0.3 s (medians of 3, benchmarks/producer_overhead.py; earlier,
    # 0.8 s against 0.25 s: 199-212 against 308-323): a message costs the sender and
    # librdkafka threads ~430 µs with cold caches.
    pack_window_ms: int = 500
    batch_size: int = 256 * 1024
    # Kafka compression (lz4, gzip, zstd, None); AUTO_COMPRESSION: see default_compression.
    compression: str | None = AUTO_COMPRESSION
    # Free space of this directory's filesystem, as disk records (see producer/disk.py).
    checkpoint_dir: str | None = None
    disk_interval_s: float = 60.0
    # The producer's own health as producer_health records (see producer/health.py); 0: none.
    health_interval_s: float = 60.0

    @classmethod
    def check_settings(cls, settings) -> None:
        """TypeError naming any of ``settings`` (names) that is not a field here: a
        misspelt one would otherwise be ignored, its default used in its place."""
        unknown = sorted(set(settings) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown producer setting(s): {', '.join(unknown)}")

    @classmethod
    def from_env(cls, env=None, **overrides) -> "ProducerConfig":
        env = os.environ if env is None else env
        spill_dir = env.get("TRAINMON_SPILL_DIR")
        cfg = cls(
            bootstrap=kafka_settings.bootstrap_servers(env),
            run_id=default_run_id(env),
            job_id=default_job_id(env),
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            topic_prefix=env.get("TRAINMON_TOPIC_PREFIX", topics.DEFAULT_PREFIX),
            kafka=kafka_settings.security_from(env),
            client=choose_client(env),
            relay=env.get("TRAINMON_RELAY") or None,
            strict=_flag(env.get("TRAINMON_STRICT")),
            enabled=not _flag(env.get("TRAINMON_DISABLED")),
            log_file=env.get("TRAINMON_LOG_FILE") or None,
            console=_flag(env.get("TRAINMON_CONSOLE")),
            compression=env.get("TRAINMON_KAFKA_COMPRESSION", AUTO_COMPRESSION) or None,
            checkpoint_dir=env.get("TRAINMON_CHECKPOINT_DIR") or None,
            disk_interval_s=_seconds(env.get("TRAINMON_DISK_INTERVAL_S"), 60.0),
            health_interval_s=_seconds(env.get("TRAINMON_PRODUCER_HEALTH_INTERVAL_S"), 60.0),
            pack_window_ms=int(_seconds(env.get("TRAINMON_PACK_WINDOW_MS"), cls.pack_window_ms)),
        )
        if spill_dir:
            cfg.spill_dir = Path(spill_dir)
        cls.check_settings(overrides)
        for key, value in overrides.items():
            setattr(cfg, key, value)
        return cfg

    def kafka_compression(self) -> str | None:
        """The compression the transport uses."""
        if self.compression == AUTO_COMPRESSION:
            return default_compression(self.linger_ms)
        return self.compression
