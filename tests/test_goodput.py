"""Goodput of a job: the synthetic three-run job of tests/goodput_job.py (a crash, a hang
killed by the NCCL watchdog, checkpoint saves, a resume that trains lost steps again),
its breakdown worked out here by hand and reproduced to the second by the ClickHouse
views, ``trainmon goodput`` and the report; where the job id comes from. chDB in a child
process (it hosts one data directory per process); no broker."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from tests.goodput_job import (EDGE_JOB, JOB, SAME_INSTANT_JOB, T0, edge_job_records, job_records,
                               same_instant_records)
from trainmon.consumers.clickhouse.goodput import CATEGORIES
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.producer import Producer, ProducerConfig
from trainmon.producer.config import default_job_id
from trainmon.producer.deferred import DeferredRecord
from trainmon.schemas import encode

REPO = Path(__file__).resolve().parents[1]
REQUEUED = "slurm-77"  # the same job requeued: one run id for all three runs, no job id

# -- the breakdown, by hand (times in seconds after T0; see tests/goodput_job.py) -----------
# Run 1: start-up 0 -> 60 (step 1). Steps 1..5 every 10 s (4 intervals: 40 s training). The
# interval 5 -> 6 (100 -> 130) holds the 20 s save and 10 s of training. Steps 6..8 (20 s).
# The crash at 155, 5 s after step 8: shorter than 3 median steps (30 s), lost progress.
# Run 2 resumed from the step-5 checkpoint (its first step is 6): the training of steps 6, 7
# and 8 in run 1 (10 + 10 + 10 s) is lost progress, not productive.
# Run 2: restart gap 155 -> 260 (run 1's end to run 2's first step, checkpoint load
# included) = 105 s. Steps 6..10: 40 s. Interval 10 -> 11 (300 -> 325): the 15 s
# evaluation and 10 s of training; 11 -> 12: 10 s; 12 -> 13 (335 -> 357): the save, logged
# as started (335) and saved (347) without a duration, 12 s, and 10 s of training; 13 -> 14:
# 10 s. The hang: step 14 at 367 to the watchdog's kill at 967, 600 s (> 30 s).
# Run 3 resumed from the step-12 checkpoint (its first step is 13): run 2's training of
# steps 13 and 14 (10 + 10 s) is lost progress.
# Run 3: restart gap 967 -> 1050 = 83 s. Steps 13..16: 30 s. 16 -> 17 (1080 -> 1130): 50 s,
# more than 3 x 10 s: 10 s of training and a 40 s stall. 17..20: 30 s. After step 20 (1160)
# the 8 s save and 2 s of shutdown to the run's end at 1170.
HAND = {
    "productive_s": (40 + 10 + 20 - 30) + (40 + 10 + 10 + 10 + 10 - 20) + (30 + 10 + 30),
    "startup_s": 60 + 2,
    "checkpoint_s": 20 + 12 + 8,
    "restart_s": 105 + 83,
    "hang_s": 600 + 40,
    "eval_s": 15,
    "lost_s": (30 + 5) + 20,
    "wall_s": 1170,
}
# The job runs past midnight (T0 is 23:50 UTC): a piece counts on the day it ends. Up to
# step 14 of run 2 (367 s after T0) on the first day; the hang, run 3 and its restart gap
# on the second.
HAND_DAYS = {
    str(T0.date()): {"productive_s": 40 + 60, "startup_s": 60, "checkpoint_s": 20 + 12,
                     "restart_s": 105, "hang_s": 0, "eval_s": 15, "lost_s": 35 + 20, "wall_s": 367},
    str((T0 + timedelta(days=1)).date()): {"productive_s": 70, "startup_s": 2, "checkpoint_s": 8,
                                           "restart_s": 83, "hang_s": 640, "eval_s": 0, "lost_s": 0,
                                           "wall_s": 1170 - 367},
}

# One child process (chDB hosts one data directory per process): load, query the views, then
# run `trainmon goodput` and `trainmon report` as the command line would, in-process.
LOAD = r"""
import contextlib, io, json, sys
from trainmon.cli import main
from trainmon.consumers.clickhouse import Target, connect, create_all, insert_records, refresh_now
from trainmon.schemas import decode

path, queries, commands = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
client = connect(Target(path=path))
create_all(client)
insert_records(client, [decode(kind, line.encode()) for kind, line in json.load(sys.stdin)])
refresh_now(client)
out = {}
for name, sql in queries.items():
    result = client.query(sql)
    out[name] = [dict(zip(result.column_names, row)) for row in result.result_rows]
client.close()
for name, argv in commands.items():
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv + ["--path", path])
    out[name] = {"returncode": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
print(json.dumps(out, default=str))
"""
QUERIES = {
    "goodput": "SELECT * FROM trainmon.goodput ORDER BY job_id",
    "daily": "SELECT * FROM trainmon.goodput_daily ORDER BY job_id, day",
    # what the Grafana panel reads: the view recomputed into a table (now, by refresh_now)
    "daily_latest": "SELECT * FROM trainmon.goodput_daily_latest ORDER BY job_id, day",
    "pieces": "SELECT job_id, time_from, time_to FROM trainmon.goodput_pieces ORDER BY job_id, time_from",
    "jobs": "SELECT run_id, job_id FROM trainmon.job_runs ORDER BY run_id",
}


# A real restart (tests/data/logs, PROVENANCE.md): a 2-node Megatron-DeepSpeed job whose log
# stopped after iteration 8, relaunched half an hour later from iteration 1 (no checkpoint).
RELAUNCH = "v100-relaunch"
RELAUNCH_LOGS = ("megatron-deepspeed-v100-2node-log-stops-iter8.log",
                 "megatron-deepspeed-v100-2node-retry-after-stop-healthy.log")


def relaunch_records() -> list:
    """Both logs read by trainmon's ingest session as one job (``trainmon ingest --job-id``)."""
    from tests.ingest_support import NOW, raw_lines
    from trainmon.ingest import Session

    records: list = []
    for name in RELAUNCH_LOGS:
        session = Session(Path(name).stem, records.append, host="v100", clock=lambda: NOW, job_id=RELAUNCH)
        for line in raw_lines(name):
            session.feed(line)
        session.finish()
    return records


def relaunch_by_hand() -> dict:
    """The relaunch's breakdown from the log text alone: each log's last
    "[before the start of training step] datetime:" plus its iterations' "elapsed time per
    iteration (ms)" date its steps; the launcher's last "exits successfully" line ends it."""
    from datetime import datetime

    from tests.ingest_support import raw_lines

    runs = []
    for name in RELAUNCH_LOGS:
        text = "\n".join(raw_lines(name))
        start = re.findall(r"\[before the start of training step\] datetime: ([\d-]+ [\d:]+)", text)[-1]
        elapsed = [float(ms) / 1000 for ms in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", text)]
        exits = re.findall(r"\[([\d-]+ [\d:]+),(\d+)\] \[INFO\] \[launch\.py:\d+:main\] Process \d+ exits", text)
        runs.append({"start": datetime.fromisoformat(start).timestamp(), "elapsed": elapsed,
                     "end": (datetime.fromisoformat(exits[-1][0]).timestamp() + int(exits[-1][1]) / 1000
                             if exits else None)})
    first, second = runs
    first_steps = [first["start"] + sum(first["elapsed"][:i + 1]) for i in range(len(first["elapsed"]))]
    second_steps = [second["start"] + sum(second["elapsed"][:i + 1]) for i in range(len(second["elapsed"]))]
    assert len(first_steps) == 8 and len(second_steps) == 20 and first["end"] is None
    return {
        # the first launch: start-up to its first iteration
        "startup_s": (first_steps[0] - first["start"]) + (second["end"] - second_steps[-1]),
        # it stopped without a run end and the relaunch began at iteration 1: iterations 2-8
        # (all it trained after its first line) are trained again
        "lost_s": first_steps[-1] - first_steps[0],
        "restart_s": second_steps[0] - first_steps[-1],
        "productive_s": second_steps[-1] - second_steps[0],
        "checkpoint_s": 0.0, "hang_s": 0.0, "eval_s": 0.0,
        "wall_s": second["end"] - first["start"],
    }


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """The job twice (three run ids with a job id; one run id, requeued) in chDB: the
    views' answers, and what ``trainmon goodput`` and ``trainmon report`` made of it."""
    tmp = tmp_path_factory.mktemp("goodput")
    db = str(tmp / "chdb")
    records = (job_records() + job_records((REQUEUED,) * 3, job_id=None) + relaunch_records()
               + job_records(("8-ranks-a", "8-ranks-b", "8-ranks-c"), job_id="8-ranks", ranks=8)
               + edge_job_records() + same_instant_records())
    wire = [[r.kind, encode(r).decode()] for r in records]
    commands = {"cli": ["goodput", "train-7b-b", "--daily"],  # a run id names its job
                "report": ["report", "train-7b-c", "-o", str(tmp / "report.html")],
                "missing": ["goodput", "no-such-job"]}
    proc = subprocess.run([sys.executable, "-c", LOAD, db, json.dumps(QUERIES), json.dumps(commands)],
                          input=json.dumps(wire), capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    for name in commands:
        out[name] = subprocess.CompletedProcess(commands[name], **out[name])
    out["report_html"] = (tmp / "report.html").read_text() if out["report"].returncode == 0 else ""
    return out


def seconds(row: dict) -> dict:
    return {k: float(row[k]) for k in HAND}


def test_the_view_reproduces_the_hand_computed_breakdown_to_the_second(loaded):
    assert sum(v for k, v in HAND.items() if k != "wall_s") == HAND["wall_s"]
    row = {r["job_id"]: r for r in loaded["goodput"]}[JOB]
    assert seconds(row) == HAND
    assert row["runs"] == 3
    assert float(row["goodput"]) == pytest.approx(170 / 1170)
    assert row["started_at"].startswith(str(T0.replace(tzinfo=None)))


def test_a_requeued_job_under_one_run_id_is_split_into_the_same_runs(loaded):
    jobs = {r["run_id"]: r["job_id"] for r in loaded["jobs"]}
    assert jobs == {"train-7b-a": JOB, "train-7b-b": JOB, "train-7b-c": JOB, REQUEUED: REQUEUED,
                    **{Path(name).stem: RELAUNCH for name in RELAUNCH_LOGS},
                    **{f"8-ranks-{x}": "8-ranks" for x in "abc"},
                    **{f"edge-{n}": EDGE_JOB for n in (1, 2, 3)},
                    "same-instant-1": SAME_INSTANT_JOB}
    row = {r["job_id"]: r for r in loaded["goodput"]}[REQUEUED]
    assert seconds(row) == HAND and row["runs"] == 3


def test_every_rank_logging_the_job_changes_nothing(loaded):
    row = {r["job_id"]: r for r in loaded["goodput"]}["8-ranks"]  # 8 ranks, 8 run starts per run
    assert seconds(row) == HAND and row["runs"] == 3


def test_durations_not_logged_a_kill_without_an_end_and_a_run_dead_in_start_up(loaded):
    """tests/goodput_job.py's edge_job_records, by hand. Run 1 steps every 10 s (its median):
    start-up 0 -> 30; 1 -> 2 -> 3: 20 s; 3 -> 4 (50 -> 75) holds the evaluation logged
    without a duration: the 15 s beyond one step's 10; 4 -> 5 (75 -> 100) the save logged
    without one: 15 s, and 10 s of training; 5 -> 6: 10 s. Killed without a run end, it
    ends at its last record (step 6, +110). Run 2 logs no step: from run 1's end to its own
    (110 -> 230) is a restart gap; so is 230 -> 350, to run 3's first step. Run 3 starts at
    step 5 and the newest checkpoint below it is step 4's: run 1's training of steps 5 and 6
    (10 + 10 s) is lost. Run 3: 5 -> 6 -> 7, 20 s; it ends at its last step."""
    row = {r["job_id"]: r for r in loaded["goodput"]}[EDGE_JOB]
    assert seconds(row) == {"productive_s": 30 + 20, "startup_s": 30, "checkpoint_s": 15,
                            "restart_s": 120 + 120, "hang_s": 0, "eval_s": 15, "lost_s": 20, "wall_s": 370}
    assert row["runs"] == 3


def test_steps_logged_at_one_instant_count_the_tail_once(loaded):
    """tests/goodput_job.py's same_instant_records: start-up 0 -> 10, training 10 -> 30 (the
    interval between the two steps at +30 is 0 s), shutdown 30 -> 40, once: both steps at +30
    are at the last step's time, but the tail follows only the last of them."""
    row = {r["job_id"]: r for r in loaded["goodput"]}[SAME_INSTANT_JOB]
    assert seconds(row) == {"productive_s": 20, "startup_s": 10 + 10, "checkpoint_s": 0, "restart_s": 0,
                            "hang_s": 0, "eval_s": 0, "lost_s": 0, "wall_s": 40}


def test_each_day_gets_the_pieces_that_end_on_it(loaded):
    days = {r["day"]: seconds(r) for r in loaded["daily"] if r["job_id"] == JOB}
    assert days == {day: {k: float(v) for k, v in hand.items()} for day, hand in HAND_DAYS.items()}


def test_the_panel_s_table_holds_the_daily_view_once_refreshed(loaded):
    assert loaded["daily_latest"] == loaded["daily"] and len(loaded["daily"]) > len(HAND_DAYS)


def test_the_pieces_tile_the_job_without_gap_or_overlap(loaded):
    pieces = [(p["time_from"], p["time_to"]) for p in loaded["pieces"] if p["job_id"] == JOB]
    assert pieces[0][0] == str(T0.replace(tzinfo=None))
    assert pieces[-1][1] == str((T0 + timedelta(seconds=1170)).replace(tzinfo=None))
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


def test_trainmon_goodput_prints_the_views_numbers(loaded):
    done = loaded["cli"]
    assert done.returncode == 0, done.stderr
    table = {m.group(1).strip(): float(m.group(2))
             for m in re.finditer(r"^([^\d\n]+?) +(\d+\.\d) +\d+:\d\d:\d\d ", done.stdout, re.M)}
    assert table == {"productive training": 170.0, "start-up and shutdown": 62.0, "checkpoint saves": 40.0,
                     "restart gaps": 188.0, "hangs and stalls": 640.0, "evaluation": 15.0,
                     "lost progress (retrained)": 55.0, "wall time": 1170.0}
    assert f"job {JOB}: 3 run(s)" in done.stdout and "goodput: 14.5 %" in done.stdout
    # --daily: one line per day, the same seconds as the view
    day_lines = [line.split() for line in done.stdout.splitlines() if re.match(r"\s*\d{4}-\d\d-\d\d ", line)]
    assert [[float(v) for v in line[1:1 + len(CATEGORIES) + 1]] for line in day_lines] == \
        [[float(hand[f"{c}_s"]) for c in CATEGORIES] + [float(hand["wall_s"])] for hand in HAND_DAYS.values()]
    missing = loaded["missing"]
    assert missing.returncode == 1 and "no job or run 'no-such-job'" in missing.stderr


def test_the_report_leads_with_the_jobs_goodput(loaded):
    assert loaded["report"].returncode == 0, loaded["report"].stderr
    page = loaded["report_html"]
    assert f"Goodput of job {JOB}: 14.5 %" in page
    section = page.split("<table class='goodput'>", 1)[1].split("</table>", 1)[0]
    cells = re.findall(r"<tr><td>([^<]+)</td><td>([\d.]+)</td>", section)
    assert {label: float(value) for label, value in cells} == {
        "productive training": 170.0, "start-up and shutdown": 62.0, "checkpoint saves": 40.0,
        "restart gaps": 188.0, "hangs and stalls": 640.0, "evaluation": 15.0,
        "lost progress (retrained)": 55.0, "wall time": 1170.0}


def test_a_real_relaunch_read_from_its_two_logs(loaded):
    row = {r["job_id"]: r for r in loaded["goodput"]}[RELAUNCH]
    hand = relaunch_by_hand()
    assert sum(v for k, v in hand.items() if k != "wall_s") == pytest.approx(hand["wall_s"])
    assert row["runs"] == 2
    assert seconds(row) == pytest.approx(hand, abs=1e-3)
    # about 28 of the job's 36 minutes went to the relaunch; the first launch's 2 minutes of
    # training were lost; the second launch's 5.6 minutes are the goodput
    assert 1650 < hand["restart_s"] < 1700 and 100 < hand["lost_s"] < 130
    assert float(row["goodput"]) == pytest.approx(hand["productive_s"] / hand["wall_s"])


# -- where the job id comes from -------------------------------------------------------------

def test_the_job_id_is_trainmon_s_else_slurm_s_else_torchrun_s():
    assert default_job_id({"TRAINMON_JOB_ID": "j", "SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "r"}) == "j"
    assert default_job_id({"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "r"}) == "77"
    assert default_job_id({"TORCHELASTIC_RUN_ID": "r"}) == "r"
    assert default_job_id({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun without --rdzv-id
    assert ProducerConfig.from_env(env={"SLURM_JOB_ID": "77"}).job_id == "77"


def test_the_producer_s_run_start_carries_the_job_id(tmp_path):
    producer = Producer(ProducerConfig(run_id="attempt-2", job_id="slurm-77", spill_dir=tmp_path),
                        transport=MemoryBroker().transport)
    sent = []
    producer._worker.submit = lambda topic, key, record: sent.append(
        DeferredRecord.from_queued(record).build() if type(record) is tuple else record)
    try:
        producer.run_start(config={})
        producer.run_start(config={}, job_id="chosen")  # given explicitly: kept
        producer.run_end("success")
    finally:
        producer.close(timeout=1)
    assert [(r.event, r.job_id) for r in sent] == [("start", "slurm-77"), ("start", "chosen"), ("end", None)]


def test_an_ingested_log_is_one_job_the_session_s_unless_told():
    from tests.ingest_support import NOW
    from trainmon.ingest import Session

    lines = ["[2026-04-10 17:04:41] iteration        1/      20 | elapsed time per iteration (ms): 900.0 | "
             "lm loss: 1.2E+01 |",
             "Traceback (most recent call last):", "RuntimeError: CUDA error: out of memory",
             "[2026-04-10 17:09:00] iteration        1/      20 | elapsed time per iteration (ms): 900.0 | "
             "lm loss: 1.2E+01 |"]
    for job_id, expected in ((None, "the-log"), ("slurm-9", "slurm-9")):
        records = []
        session = Session("the-log", records.append, fmt="megatron", host="h", clock=lambda: NOW, job_id=job_id)
        for line in lines:
            session.feed(line)
        session.finish()
        runs = [r for r in records if r.kind == "run"]
        assert [(r.event, r.job_id) for r in runs] == [("start", expected), ("end", None), ("start", expected)]
        # the traceback has no timestamp: the run ends at the log's latest one, not when read
        assert runs[1].time.isoformat() == "2026-04-10T17:04:41+00:00"


# -- dating a log's undated step lines (pure) ----------------------------------------------------

def test_undated_steps_follow_the_log_s_clock_and_a_restart_starts_again_from_it():
    from datetime import datetime, timezone

    from trainmon.ingest.dating import StepClock

    t0 = datetime(2026, 4, 10, 16, 34, 22, tzinfo=timezone.utc)
    clock = StepClock()
    assert clock.date(1, 1000.0) is None  # no timestamp read yet
    clock.saw_time(t0)
    assert clock.date(1, 1000.0) == t0 + timedelta(seconds=1)
    assert clock.date(11, 500.0) == t0 + timedelta(seconds=6)  # 10 iterations of 0.5 s
    assert clock.date(12, None) is None and clock.date(12, float("nan")) is None
    # a later timestamp does not move the running sequence: the step read after it may have
    # been printed before it (a parser holds a step for its timer lines)
    clock.saw_time(t0 + timedelta(seconds=60))
    assert clock.date(12, 1000.0) == t0 + timedelta(seconds=7)
    # the step number goes back: a restart in the same log, dated from the latest timestamp
    clock.saw_time(t0 + timedelta(seconds=600))
    assert clock.date(6, 2000.0) == t0 + timedelta(seconds=602)
