"""A synthetic job of three runs for the goodput tests, with its breakdown worked out by
hand (tests/test_goodput.py holds the arithmetic). One rank; a step every 10 s when all
is well, so each run's median time per step is 10 s and a hang is a gap over 30 s.

Run 1 starts at T0, logs step 1 at +60, saves a checkpoint after step 5 (20 s, logged
with its duration), logs up to step 8 (+150) and crashes at +155.
Run 2 starts at +200, loads the step-5 checkpoint, logs steps 6..14 from +260 with an
evaluation after step 10 (15 s, logged) and a save after step 12 (12 s, logged as
"started" and "saved" without a duration); after step 14 (+367) it hangs until the NCCL
watchdog kills it at +967.
Run 3 starts at +1000, loads the step-12 checkpoint, logs steps 13..20 from +1050 with a
50 s gap after step 16 (a stall), saves after step 20 (8 s) and ends well at +1170.

T0 is 23:50 UTC: the job runs into the next day (the hang ends on it).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from itertools import count

from trainmon.schemas import CheckpointRecord, EvalRecord, Record, RunRecord, StepRecord

T0 = datetime(2026, 3, 1, 23, 50, tzinfo=timezone.utc)
JOB = "train-7b"


def job_records(run_ids: tuple[str, str, str] = ("train-7b-a", "train-7b-b", "train-7b-c"),
                job_id: str | None = JOB, ranks: int = 1) -> list[Record]:
    """The job's records; ``run_ids`` may repeat one id (a requeued Slurm job keeps it).
    ``ranks``: every record logged by that many ranks at the same instant."""
    ids = count()
    out: list[Record] = []

    def env(run: int, second: float) -> dict:
        return dict(run_id=run_ids[run], rank=0, world_size=1, host="node-0",
                    time=T0 + timedelta(seconds=second), event_id=f"{run_ids[run]}-{next(ids)}")

    def start(run: int, second: float) -> None:
        out.append(RunRecord(**env(run, second), event="start", name="7b",
                             **({"job_id": job_id} if job_id else {})))

    def steps(run: int, first_step: int, times: list[float]) -> None:
        for i, second in enumerate(times):
            out.append(StepRecord(**env(run, second), step=first_step + i, loss=3.0,
                                  duration_ms=10_000.0, step_tokens=4096))

    # run 1: start-up 60 s, steps 1-5, a 20 s save, steps 6-8, a crash 5 s later
    start(0, 0)
    steps(0, 1, [60, 70, 80, 90, 100])
    out.append(CheckpointRecord(**env(0, 120), step=5, duration_ms=20_000.0, path="/ckpt/5"))
    steps(0, 6, [130, 140, 150])
    out.append(RunRecord(**env(0, 155), event="end", status="failed",
                         reason="RuntimeError: CUDA error: an illegal memory access was encountered"))
    # run 2: resumes from step 5; an evaluation, a save without its duration, then a hang
    start(1, 200)
    steps(1, 6, [260, 270, 280, 290, 300])
    out.append(EvalRecord(**env(1, 315), step=10, loss=2.9, duration_ms=15_000.0))
    steps(1, 11, [325, 335])
    out.append(CheckpointRecord(**env(1, 335), step=12, event="started", path="/ckpt/12"))
    out.append(CheckpointRecord(**env(1, 347), step=12, event="saved", path="/ckpt/12"))
    steps(1, 13, [357, 367])
    out.append(RunRecord(**env(1, 967), event="end", status="failed",
                         reason="Watchdog caught collective operation timeout: WorkNCCL(SeqNum=88, "
                                "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out."))
    # run 3: resumes from step 12; a 50 s stall after step 16; a final save; ends well
    start(2, 1000)
    steps(2, 13, [1050, 1060, 1070, 1080])
    steps(2, 17, [1130, 1140, 1150, 1160])
    out.append(CheckpointRecord(**env(2, 1168), step=20, duration_ms=8_000.0, path="/ckpt/20"))
    out.append(RunRecord(**env(2, 1170), event="end", status="success"))
    return [r.model_copy(update={"rank": rank, "world_size": ranks, "event_id": f"{r.event_id}-{rank}"})
            if rank else r for rank in range(ranks) for r in out]


EDGE_JOB = "edge-cases"


def edge_job_records() -> list[Record]:
    """What the three-run job leaves out (tests/test_goodput.py works it out): an evaluation
    and a save logged without any duration, a run killed without a run end, a run that died
    in its start-up without logging a step, and a resume past a checkpoint.

    Run 1 starts at T0, logs steps 1-3 at +30, +40, +50, an evaluation (no duration) at +65,
    step 4 at +75, a save of step 4 (no duration, no "started") at +90, steps 5 and 6 at +100
    and +110, and is killed (no run end). Run 2 starts at +200 and fails at +230 without a
    step. Run 3 starts at +300, resumes from the step-4 checkpoint (its first step is 5 at
    +350), logs steps 6 and 7 and ends well at +370."""
    ids = count()
    out: list[Record] = []

    def env(run: int, second: float) -> dict:
        return dict(run_id=f"edge-{run}", rank=0, world_size=1, host="node-0",
                    time=T0 + timedelta(seconds=second), event_id=f"edge-{next(ids)}")

    def step(run: int, number: int, second: float) -> None:
        out.append(StepRecord(**env(run, second), step=number, loss=3.0))

    out.append(RunRecord(**env(1, 0), event="start", job_id=EDGE_JOB))
    for number, second in ((1, 30), (2, 40), (3, 50)):
        step(1, number, second)
    out.append(EvalRecord(**env(1, 65), step=3, loss=2.9))
    step(1, 4, 75)
    out.append(CheckpointRecord(**env(1, 90), step=4, path="/ckpt/4"))
    step(1, 5, 100)
    step(1, 6, 110)
    out.append(RunRecord(**env(2, 200), event="start", job_id=EDGE_JOB))
    out.append(RunRecord(**env(2, 230), event="end", status="failed", reason="NCCL error: unhandled system error"))
    out.append(RunRecord(**env(3, 300), event="start", job_id=EDGE_JOB))
    for number, second in ((5, 350), (6, 360), (7, 370)):
        step(3, number, second)
    out.append(RunRecord(**env(3, 370), event="end", status="success"))
    return out


SAME_INSTANT_JOB = "same-instant"


def same_instant_records() -> list[Record]:
    """A run whose last two steps carry one timestamp (a log printing whole seconds, steps
    faster than that): start at T0, steps 1-4 at +10, +20, +30, +30, a good end at +40."""
    ids = count()

    def env(second: float) -> dict:
        return dict(run_id="same-instant-1", rank=0, world_size=1, host="node-0",
                    time=T0 + timedelta(seconds=second), event_id=f"same-instant-{next(ids)}")

    return [RunRecord(**env(0), event="start", job_id=SAME_INSTANT_JOB),
            *(StepRecord(**env(second), step=number, loss=3.0)
              for number, second in ((1, 10), (2, 20), (3, 30), (4, 30))),
            RunRecord(**env(40), event="end", status="success")]
