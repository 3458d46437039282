"""Checkpoints, free space and log events.

- ``log_checkpoint`` and the producer's free-space thread (TRAINMON_CHECKPOINT_DIR) through
  the real broker into ClickHouse, with a gpu_health record and the log events of a
  corpus log beside them (the tables come from the schemas: arrays, Nullable bools,
  LowCardinality sources);
- the disk thread: off the training thread, silent about a filesystem it cannot measure;
- the ingest parsers picking up checkpoint lines and NCCL / c10 / Python warning lines
  from corpus logs that have them (tests/data/logs), and from the frameworks' own print
  formats where the corpus has no such line.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone


import trainmon.producer as tm
from trainmon.ingest.warnings import classify, signature
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.producer import Producer, ProducerConfig
from trainmon.producer.disk import DiskSampler, disk_fields, measured_path

from .clickhouse_service import ClickHouseService, trainmon_env
from .clickhouse_service import kill_leftover_services  # noqa: F401 (autouse fixture)
from .ingest_support import LOGS, ingest, of_kind, raw_lines
from .waiting import wait_until

GIB = 2**30


# -- end to end: producer -> Kafka -> ClickHouse ---------------------------------------------

def test_checkpoints_free_space_health_and_log_events_land_in_clickhouse(
        make_producer, bootstrap, topic_prefix, tmp_path, monkeypatch):
    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "ch", tmp_path / "service.log").start()
    ckpt_dir = tmp_path / "checkpoints" / "run-1"  # not made yet: measured at tmp_path
    producer = make_producer(run_id="ckpt-run", checkpoint_dir=str(ckpt_dir), disk_interval_s=3600)
    monkeypatch.setattr(tm, "_default", producer)  # the module-level calls use this producer
    wait_until(lambda: producer._disk.samples >= 1)  # the first measurement, at start
    for step in range(1, 6):
        assert tm.log_step(step, loss=2.0)
    assert tm.log_checkpoint(5, path=str(ckpt_dir / "iter_0000005"), bytes=14 * GIB, duration_ms=2345.5)
    wait_until(lambda: producer._disk.samples >= 2)  # measured again right after the save
    assert producer.log_checkpoint(6)  # what a loop that knows nothing else can log
    assert producer.log_gpu_health(6, id=1, ecc_volatile_uncorrected=0, remapped_rows_pending=True,
                                   xids=[79, 48])
    wait_until(lambda: producer._disk.samples >= 3)
    assert producer.flush(30)

    service.wait_for("SELECT count() FROM trainmon.checkpoint FINAL WHERE run_id = 'ckpt-run'", 2)
    rows = service.rows("SELECT step, event, path, bytes, duration_ms, free_bytes FROM trainmon.checkpoint "
                        "FINAL WHERE run_id = 'ckpt-run' ORDER BY step")
    assert rows == [
        {"step": 5, "event": "saved", "path": str(ckpt_dir / "iter_0000005"), "bytes": 14 * GIB,
         "duration_ms": 2345.5, "free_bytes": None},
        {"step": 6, "event": "saved", "path": None, "bytes": None, "duration_ms": None, "free_bytes": None}]

    service.wait_for("SELECT count() FROM trainmon.disk FINAL WHERE run_id = 'ckpt-run'", 3)
    disks = service.rows("SELECT step, path, free_bytes, total_bytes, used_bytes FROM trainmon.disk "
                         "FINAL WHERE run_id = 'ckpt-run' ORDER BY step, _offset")
    now = shutil.disk_usage(tmp_path)
    assert [d["step"] for d in disks] == [0, 5, 6]  # at start, then right after each save
    for d in disks:
        assert d["path"] == str(ckpt_dir) and d["total_bytes"] == now.total
        assert abs(d["free_bytes"] - now.free) < GIB and d["used_bytes"] + d["free_bytes"] <= now.total

    service.wait_for("SELECT count() FROM trainmon.gpu_health FINAL WHERE run_id = 'ckpt-run'", 1)
    (health,) = service.rows("SELECT id, xids, xid_count, remapped_rows_pending, ecc_volatile_uncorrected, "
                             "ecc_aggregate_corrected, nvlink_crc_flit_errors FROM trainmon.gpu_health "
                             "FINAL WHERE run_id = 'ckpt-run'")
    assert health == {"id": 1, "xids": [79, 48], "xid_count": 2, "remapped_rows_pending": True,
                      "ecc_volatile_uncorrected": 0, "ecc_aggregate_corrected": None,
                      "nvlink_crc_flit_errors": None}

    # A crashed two-node Megatron-DeepSpeed log, read twice: its NCCL lines as log events, once.
    log = LOGS / "megatron-deepspeed-2node-dataset-missing-traceback-nccl-watchdog.log"
    env = trainmon_env(bootstrap, TRAINMON_TOPIC_PREFIX=topic_prefix, TRAINMON_SPILL_DIR=tmp_path / "spill")
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "trainmon", "ingest", str(log), "--run-id", "crash"],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    service.wait_for("SELECT count() FROM trainmon.log_event FINAL WHERE run_id = 'crash'", 37)
    assert service.value("SELECT uniqExact(event_id) FROM trainmon.log_event WHERE run_id = 'crash'") == 37
    (warn,) = service.rows("SELECT rank, level, source, count, text, toString(time) AS time FROM "
                           "trainmon.log_event FINAL WHERE run_id = 'crash' AND level = 'warning' "
                           "AND signature LIKE 'NCCL WARN%'")
    assert warn == {"rank": 0, "level": "warning", "source": "nccl", "count": 1,
                    "text": "NCCL WARN socketProgress: Connection closed by remote peer "
                            "v100x16-2.example.com<59840>", "time": "2026-03-28 16:19:30.000000"}
    service.stop()


# -- the disk thread -----------------------------------------------------------------------------

def test_free_space_is_measured_on_the_disk_thread_never_the_training_thread(make_producer, tmp_path,
                                                                               monkeypatch):
    threads, real = [], shutil.disk_usage

    def slow_statvfs(path):  # a hung network filesystem
        threads.append(threading.current_thread().name)
        time.sleep(0.3)
        return real(path)

    monkeypatch.setattr(shutil, "disk_usage", slow_statvfs)
    producer = make_producer(checkpoint_dir=str(tmp_path), disk_interval_s=3600)
    started = time.monotonic()
    for step in range(3):
        assert producer.log_step(step, loss=1.0)
        assert producer.log_checkpoint(step, path=str(tmp_path / f"step{step}"))
    assert time.monotonic() - started < 0.2  # three saves logged while one statvfs hangs
    wait_until(lambda: producer._disk.samples >= 2)
    producer.close()
    assert threads and set(threads) == {"trainmon-disk"}


def test_a_filesystem_that_cannot_be_measured_is_said_once_and_nothing_raises(tmp_path, caplog):
    sent = []

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    sampler = DiskSampler(sent.append, tmp_path / "ckpt", interval_s=0.01, usage=denied).start()
    with caplog.at_level(logging.WARNING, logger="trainmon.producer"):
        for _ in range(5):
            sampler.nudge(3)
            time.sleep(0.02)
        sampler.stop()
    said = [r for r in caplog.records if "cannot measure the free space" in r.getMessage()]
    assert len(said) == 1 and "Permission denied" in said[0].getMessage()
    assert sent == [] and sampler.samples == 0


def test_disk_fields_by_hand_and_a_directory_not_made_yet(tmp_path):
    usage = lambda path: shutil._ntuple_diskusage(total=8 * GIB, used=6 * GIB, free=1 * GIB)  # noqa: E731
    assert disk_fields(tmp_path / "a" / "b", usage) == {
        "path": str(tmp_path / "a" / "b"), "free_bytes": GIB, "total_bytes": 8 * GIB, "used_bytes": 6 * GIB}
    assert measured_path(tmp_path / "a" / "b") == tmp_path
    assert measured_path(tmp_path) == tmp_path


def test_the_disk_thread_runs_only_where_asked_and_on_local_rank_0(tmp_path):
    def made(**settings):
        # A MemoryBroker, not a Kafka client: only whether a disk thread starts is asked here.
        producer = Producer(ProducerConfig(run_id="r", spill_dir=tmp_path / "spill", **settings),
                            transport=MemoryBroker().transport)
        on = producer._disk is not None
        producer.close(timeout=0.1)
        return on

    assert not made()
    assert made(checkpoint_dir=str(tmp_path))
    assert not made(checkpoint_dir=str(tmp_path), local_rank=1)  # one per host
    assert not made(checkpoint_dir=str(tmp_path), disk_interval_s=0)
    assert not made(checkpoint_dir=str(tmp_path), enabled=False)
    cfg = ProducerConfig.from_env({"TRAINMON_CHECKPOINT_DIR": "/ckpt", "TRAINMON_DISK_INTERVAL_S": "15"})
    assert (cfg.checkpoint_dir, cfg.disk_interval_s) == ("/ckpt", 15.0)
    cfg = ProducerConfig.from_env({"TRAINMON_DISK_INTERVAL_S": "soon"})
    assert (cfg.checkpoint_dir, cfg.disk_interval_s) == (None, 60.0)


# -- ingest: checkpoint lines ------------------------------------------------------------------

def checkpoints(records) -> list[tuple]:
    return [(r.step, r.event, r.path, r.duration_ms) for r in of_kind(records, "checkpoint")]


def test_nanogpt_checkpoint_lines():
    # "step 100: train loss 3.4633, val loss 3.4987" then "saving checkpoint to out-kirin"
    _, records = ingest(raw_lines("nanogpt-shakespeare-char-nan-loss.log"))
    assert checkpoints(records) == [(s, "saved", "out-kirin", None) for s in (100, 200, 300, 400)]
    # A fork's archive, "saving checkpoint -> out-tinystories/ckpt_000128.pt", names its step.
    _, records = ingest(raw_lines("nanogpt-tinystories-50m-healthy.log"))
    saved = checkpoints(records)
    assert len(saved) == 37
    assert saved[:5] == [(s, "saved", f"out-tinystories/ckpt_{s:06d}.pt", None) for s in (0, 1, 2, 4, 8)]
    assert (250, "saved", "out-tinystories", None) in saved
    assert [s for s, _, path, _ in saved if path == "out-tinystories"] == list(range(250, 5751, 250))


def test_hf_trainer_checkpoint_lines_and_a_save_after_the_end_starts_no_run():
    # "[INFO|trainer.py:4074] ... >> Saving model checkpoint to saves/qwen3-0.6b/lora/sft/checkpoint-411",
    # then the final save_model after the train_runtime summary.
    session, records = ingest(raw_lines("hf-trainer-llamafactory-qwen3-0.6b-sft-healthy.log"))
    assert checkpoints(records) == [(411, "saved", "saves/qwen3-0.6b/lora/sft/checkpoint-411", None),
                                    (411, "saved", "saves/qwen3-0.6b/lora/sft", None)]
    assert [(r.event, r.status) for r in of_kind(records, "run")] == [("start", "running"), ("end", "success")]


def test_megatron_checkpoint_lines_with_the_save_timer_or_timestamps():
    lines = [  # Megatron-Core's prints (training.py, checkpointing.py)
        " iteration      100/     200 | consumed samples:        51200 | lm loss: 7.123456E+00 |",
        "saving checkpoint at iteration     100 to /ckpt/gpt in torch_dist format",
        "  successfully saved checkpoint from iteration     100 to /ckpt/gpt [ t 1/8, p 1/1 ]",
        "(min, max) time across ranks (ms):",
        "    save-checkpoint ................................: (2345.12, 2401.50)",
        " iteration      110/     200 | consumed samples:        56320 | lm loss: 7.023456E+00 |",
        "[2024-06-13 10:49:00] saving checkpoint at iteration     110 to /ckpt/gpt",
        "[2024-06-13 10:49:03] successfully saved checkpoint at iteration     110 to /ckpt/gpt",
        "[2024-06-13 10:49:05] saving checkpoint at iteration     120 to /ckpt/gpt",  # never finished
        "  successfully loaded checkpoint from /ckpt/gpt at iteration 120",
    ]
    session, records = ingest(lines)
    assert session.format == "megatron"
    assert checkpoints(records) == [(100, "started", "/ckpt/gpt", None), (100, "saved", "/ckpt/gpt", 2401.5),
                                    (110, "started", "/ckpt/gpt", None), (110, "saved", "/ckpt/gpt", 3000.0),
                                    (120, "started", "/ckpt/gpt", None)]
    steps = {r.step: r for r in of_kind(records, "step")}
    assert steps[100].timers == {"save-checkpoint": 2401.5, "save-checkpoint.min": 2345.12}  # as before


def test_nemo_checkpoint_lines_one_record_per_save():
    lines = [
        "Training epoch 0, iteration 48/99 | lr: 3e-05 | global_step: 48 | reduced_train_loss: 1.274",
        "[NeMo I 2026-02-17 17:59:05 nemo_logging:393] Global Checkpoint Save : Rank: 0 : Iteration: 49 : "
        "Start time: 1771351145.879s : Save duration: 5.330s",
        "[NeMo I 2026-02-17 17:59:06 nemo_logging:393] Scheduled async checkpoint save for /ckpt/step=49.ckpt",
        "[NeMo I 2026-02-17 17:59:15 nemo_logging:393] Successfully saved checkpoint from iteration 49 to "
        "/ckpt/step=49.ckpt",
        "[NeMo I 2026-02-17 17:59:15 nemo_logging:393] Async checkpoint save for step 50 (/ckpt/step=49.ckpt) "
        "finalized successfully.",
        "[NeMo I 2025-06-18 22:03:05 nemo_logging:393] Async checkpoint save for step 5 "
        "(/ckpt/evo2--val_loss=0.0000-epoch=0-consumed_samples=5.0-last.ckpt) finalized successfully.",
        "Epoch 0, global step 100: 'val_loss' reached 2.34567 (best 2.34567), saving model to "
        "'/ckpt/epoch=0-step=100.ckpt' as top 3",
        "Epoch 0, global step 200: 'val_loss' was not in top 3",
    ]
    session, records = ingest(lines)
    assert session.format == "nemo"
    assert checkpoints(records) == [
        (49, "saved", "/ckpt/step=49.ckpt", 5330.0),
        (4, "saved", "/ckpt/evo2--val_loss=0.0000-epoch=0-consumed_samples=5.0-last.ckpt", None),
        (100, "saved", "/ckpt/epoch=0-step=100.ckpt", None)]


def test_torchtitan_checkpoint_lines():
    lines = [
        "[rank0]:[titan] 2025-04-01 00:25:47,084 - root - INFO - step: 640  loss:  6.2116  memory: "
        "87.04GiB(93.48%)  tps: 52,142  mfu: 3.09%",
        "[rank0]:[titan] 2025-04-01 00:25:50,000 - root - INFO - Saving the checkpoint (or staging if async "
        "is enabled).",
        "[rank0]:[titan] 2025-04-01 00:25:55,530 - root - INFO - Finished saving the checkpoint (or staging "
        "if async is enabled)in 5.53 seconds.",
        "[rank0]:[titan] 2025-04-01 00:26:48,000 - root - INFO - Saving a model weights only checkpoint in "
        "torch.bfloat16 at last step, step 660.",
        "[rank0]:[titan] 2025-04-01 00:26:49,000 - root - INFO - Finished saving the checkpoint in 0.60 seconds.",
    ]
    session, records = ingest(lines)
    assert session.format == "torchtitan"
    assert checkpoints(records) == [(640, "started", None, None), (640, "saved", None, 5530.0),
                                    (660, "started", None, None), (660, "saved", None, 600.0)]
    assert of_kind(records, "checkpoint")[1].time == datetime(2025, 4, 1, 0, 25, 55, 530000, timezone.utc)


# -- ingest: NCCL, c10 and Python warnings -----------------------------------------------------

def events(records, **match) -> list:
    return [r for r in of_kind(records, "log_event") if all(getattr(r, k) == v for k, v in match.items())]


def test_nccl_warn_line_of_a_two_node_crash():
    # "localhost: [2026-03-28 16:19:30] DGX2-1:774320:778899 [0] misc/socket.cc:72 NCCL WARN
    #  socketProgress: Connection closed by remote peer v100x16-2.example.com<59840>"
    _, records = ingest(raw_lines("megatron-deepspeed-2node-dataset-missing-traceback-nccl-watchdog.log"))
    (warn,) = [e for e in events(records, level="warning") if e.signature.startswith("NCCL WARN")]
    assert (warn.rank, warn.source, warn.count, warn.host) == (0, "nccl", 1, "localhost")
    assert warn.signature == "NCCL WARN socketProgress: Connection closed by remote peer v100x16-N.example.com<N>"
    assert warn.time == datetime(2026, 3, 28, 16, 19, 30, tzinfo=timezone.utc)
    assert warn.first_step is None  # the job crashed before its first step
    # The watchdog's c10 error lines, per rank: "[rank0]:[E328 16:29:29.89 ProcessGroupNCCL.cpp:683]
    # [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, ...)"
    watchdog = events(records, source="nccl", level="error", rank=0)
    assert any("Watchdog caught collective operation timeout" in e.signature for e in watchdog)
    fatal = events(records, level="error")
    assert {e.rank for e in fatal if "Terminating the process" in e.signature} == {5, 6, 7}


def test_c10_warnings_at_exit_one_record_per_rank_and_no_run_start():
    # "sd-2: [rank5]:[W419 13:38:00.049160695 ProcessGroupNCCL.cpp:1553] Warning: WARNING:
    #  destroy_process_group() was not called before program exit, ..." on each of 8 ranks.
    lines = raw_lines("megatron-deepspeed-qwen25-7b-finetune-gradnorm.log")
    _, records = ingest(lines)
    warned = events(records, source="nccl", level="warning")
    assert sorted(e.rank for e in warned) == list(range(8))
    assert {e.count for e in warned} == {1} and len({e.signature for e in warned}) == 1
    assert warned[0].signature.startswith("ProcessGroupNCCL.cpp: Warning: WARNING: destroy_process_group() "
                                          "was not called before program exit")
    assert {e.last_step for e in warned} <= {19, 20}  # the run's step (rank 0 prints them)
    # The warnings, printed after the run ended, start no run on any rank.
    _, without = ingest([line for line in lines if "destroy_process_group" not in line])
    assert [(r.rank, r.event) for r in of_kind(records, "run")] == \
        [(r.rank, r.event) for r in of_kind(without, "run")]


def test_a_repeated_watchdog_error_is_counted_not_repeated():
    # Megatron-LM on 4 GPUs: "[E ProcessGroupNCCL.cpp:828] [Rank 3] Watchdog caught collective
    # operation timeout: WorkNCCL(SeqNum=33, ...)", then the same on rank 0 three times.
    _, records = ingest(raw_lines("megatron-lm-4gpu-second-iteration-nccl-watchdog-timeout.log"))
    found = [e for e in events(records, source="nccl", level="error") if "Watchdog caught" in e.signature]
    assert [e.count for e in found] == [1, 2, 4]  # first, doubling, and the final count
    assert len({e.signature for e in found}) == 1 and len({e.event_id for e in found}) == 3
    assert found[-1].last_step is None  # no iteration was logged before the hang


def test_python_warnings():
    # "[rank0]:/workspace/.../_fsdp_state.py:336: UserWarning: FSDP2-wrapped module
    #  (FSDPKimiK3TransformerBlock) returned a view tensor. ..." twice, FutureWarnings from spmd_types.
    _, records = ingest(raw_lines("torchtitan-kimik3-probe-cp2-20steps-healthy.log"))
    found = events(records, source="python")
    assert Counter(e.signature.split(":")[0] for e in found) == {"UserWarning": 2, "FutureWarning": 3}
    user = [e for e in found if e.signature.startswith("UserWarning")]
    assert [e.count for e in user] == [1, 2]
    assert user[0].signature.startswith("UserWarning: FSDP2-wrapped module (FSDPKimiK3TransformerBlock)")
    assert user[0].text.startswith("/workspace/venv_cu126/lib/python3.12/site-packages/torch/distributed/"
                                   "fsdp/_fully_shard/_fsdp_state.py:336: UserWarning:")
    _, records = ingest(raw_lines("nanogpt-shakespeare-char-nan-loss.log"))
    (future,) = events(records, source="python")
    assert future.signature == ("FutureWarning: `torch.cuda.amp.GradScaler(args...)` is deprecated. "
                                "Please use `torch.amp.GradScaler('cuda', args...)` instead.")
    assert (future.level, future.first_step, future.last_step) == ("warning", None, None)


def test_a_flood_is_a_few_records_with_stable_ids():
    # (Megatron holds a step until its timer lines: iteration 2 sends step 1.)
    lines = [" iteration        1/     100 | lm loss: 7.0 |", " iteration        2/     100 | lm loss: 6.9 |"]
    lines += [f"[rank{r}]:node-1:1234:{5678 + i} [0] misc/socket.cc:{72 + i % 3} NCCL WARN "
              f"socketProgress: Connection closed by remote peer node-2<{40000 + i}>"
              for i in range(1000) for r in (0, 1)]
    _, first = ingest(lines)
    found = of_kind(first, "log_event")
    assert [e.count for e in found if e.rank == 0] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]
    assert [e.count for e in found if e.rank == 1] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]
    assert {e.first_step for e in found} == {e.last_step for e in found} == {1}
    _, again = ingest(lines)
    assert [e.event_id for e in of_kind(again, "log_event")] == [e.event_id for e in found]
    assert len({e.event_id for e in found}) == len(found)


def test_what_is_a_warning_and_what_is_not():
    cases = {
        "DGX2-1:1:2 [0] misc/socket.cc:72 NCCL WARN Call to connect returned Connection refused":
            ("nccl", "warning"),
        "[W328 16:19:30.66 ProcessGroupNCCL.cpp:1524] Warning: WARNING: destroy_process_group()": ("nccl", "warning"),
        "[E socket.cpp:957] [c10d] The client socket has timed out after 1800s": ("torch", "error"),
        "torch.distributed.DistBackendError: NCCL error in: ../ProcessGroupNCCL.cpp:1970, unhandled "
        "system error": ("nccl", "error"),
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed": ("nccl", "error"),
        "RuntimeError: CUDA error: an illegal memory access was encountered": ("cuda", "error"),
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": ("cuda", "error"),
        "RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`": ("cuda", "error"),
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.": ("xid", "error"),
        "/opt/lib/python3.10/site-packages/torch/nn/modules/module.py:1511: UserWarning: x": ("python", "warning"),
        "train.py:12: DeprecationWarning: `np.bool` is a deprecated alias": ("python", "warning"),
    }
    for line, expected in cases.items():
        found = classify(line)
        assert found is not None and (found.source, found.level) == expected, line
    assert classify("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.").signature == "Xid 79"
    for line in ("DGX2-1:1:2 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0",
                 "[I328 16:19:30.66 ProcessGroupNCCL.cpp:1524] [PG 0 Rank 0] ProcessGroupNCCL initialized",
                 " iteration      100/  500000 | consumed samples: 51200 | lm loss: 7.1E+00 |",
                 "Warning: NaN or Inf found in input tensor.",  # a print, not the warnings module
                 '{"log": "log_event", "text": "train.py:1: UserWarning: read back"}',
                 "  CUDA_DEVICE_MAX_CONNECTIONS ..................... 1"):
        assert classify(line) is None, line
    assert signature("SeqNum=96117, Timeout(ms)=1800000 at 0x7f3a9c FSDP2 v100x16") == \
        "SeqNum=N, Timeout(ms)=N at 0x? FSDP2 v100x16"


# -- W&B / Aim / TensorBoard names -------------------------------------------------------------

def test_metric_names_for_checkpoints_free_space_and_gpu_health():
    from trainmon.consumers.metric_names import MIB, STEP_KINDS, scalars, stream_key
    from trainmon.schemas import CheckpointRecord, DiskRecord, GpuHealthRecord

    envelope = dict(run_id="r", rank=2, world_size=4, host="h", time="2025-01-01T00:00:00Z", event_id="e")
    saved = CheckpointRecord(**envelope, step=5, path="/ckpt", bytes=3 * MIB, duration_ms=2500.0)
    started = CheckpointRecord(**envelope, step=5, event="started")
    assert [(s.flat_name(2), s.value) for s in scalars(saved)] == \
        [("rank2/checkpoint/duration_ms", 2500.0), ("rank2/checkpoint/size_mib", 3.0)]
    assert scalars(started) == []  # a curve of finished saves only
    assert stream_key(saved) != stream_key(started)  # both at step 5: neither skips the other
    disk = DiskRecord(**envelope, step=5, path="/ckpt", free_bytes=10 * MIB, total_bytes=40 * MIB,
                      used_bytes=30 * MIB)
    assert [(s.metric, s.value) for s in scalars(disk)] == \
        [("disk/free_mib", 10.0), ("disk/used_mib", 30.0), ("disk/total_mib", 40.0)]
    health = GpuHealthRecord(**envelope, step=5, id=3, ecc_volatile_uncorrected=0, remapped_rows_pending=True,
                             xids=[79], nvlink_crc_flit_errors=12)
    assert [(s.flat_name(0), s.aim_name(), s.value) for s in scalars(health)] == [
        ("gpu/3/ecc_volatile_uncorrected", "gpu/3/ecc_volatile_uncorrected", 0.0),
        ("gpu/3/remapped_rows_pending", "gpu/3/remapped_rows_pending", 1.0),
        ("gpu/3/xid_count", "gpu/3/xid_count", 1.0),
        ("gpu/3/nvlink_crc_flit_errors", "gpu/3/nvlink_crc_flit_errors", 12.0)]  # absent: no point
    assert stream_key(health) == "2/gpu_health/3"
    assert {"gpu_health", "checkpoint", "disk"} <= set(STEP_KINDS)
