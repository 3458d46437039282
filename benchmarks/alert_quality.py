"""Alert quality: do the shipped alert rules catch the labelled incidents of the real-log
corpus, and stay quiet on healthy runs?

    .venv/bin/python benchmarks/alert_quality.py

No broker, no services: everything runs in memory and takes a few seconds.

What it does
------------
1. Every log in ``tests/data/logs/`` is read by the ingest parsers (``Session``, format
   auto-detected, as ``trainmon ingest`` would), and the records the alerts service
   subscribes to (step, eval, moe, gpu, run) go through a fresh ``AlertEngine`` with the shipped
   default settings (``load_config(env={})``: no YAML file, no TRAINMON_ALERT_* variables).
2. The firing alerts are scored against ``tests/data/logs/LABELS.yaml``:

   - An incident's **window** runs from its ``first_step`` to its ``last_step`` plus one more
     logged step record of the alerting rank (so an alert one logged record late still
     counts). An incident whose label gives no steps (``null``: the log prints none) spans
     the whole log.
   - An incident is **caught** by the first firing alert inside its window whose rule is one
     of those that ``KIND_RULES`` lists for its kind (a NaN is caught by ``non_finite``, not
     by a loss-scale alert that happens to fire at the same step). A kind with no rule
     still counts, as missed.
   - **Detection delay**: the number of step records of the alerting rank logged from the
     incident's first step up to (not including) the alert's step: 0 means the alert came
     with the first bad record, 1 with the next one.
   - A **false alert** is a firing alert outside every incident's window. Alerts of severity
     ``info`` (iteration-time spike, loss plateau) are listed but not counted as false
     alerts: nobody is paged for them. Alerts inside a window that caught nothing (another
     kind's rule) are listed and count neither way.
3. Synthetic healthy controls, generated here with fixed seeds (``CONTROLS``): warm-up +
   cosine and WSD schedules, an fp16 loss-scale warm-up with its routine skipped steps and
   occasional later halvings, +-15 % step-time jitter per rank, a checkpoint step 10x
   slower every 200 steps, an eval inside the step every 250 steps (its time shows as that
   step's longer time, its loss as an eval record), a slow first step, 1-8 ranks,
   2,000-3,000 steps each, loss falling with 2 % noise, grad norm noisy around a slowly
   falling level with rare benign bumps. Each should give no (non-info) alert.
4. The issue's targets, each met or missed: recall >= 95 % of the labelled incidents; no
   alert on healthy real runs nor on the synthetic ones; median detection delay <= 1 logged
   record.
5. The mid-run variant: every log again from its middle line on, the first half dropped and
   nothing else told (no config, no earlier step, no baseline: what ``trainmon ingest
   --follow`` started mid-run, a backfilled excerpt or a restarted engine without its
   checkpoint sees), and every synthetic control from its middle record on. Its incidents
   are those of the second half (``second_half``); targets: >= 90 % of them caught, no
   alert on a healthy log's or control's second half. Both tables are printed.

Time
----
The rules decide on record time. Lines with a timestamp keep it. Records from lines without
one would get the ingest time (all within a few milliseconds, which would make every
cooldown and the rate limit look like one burst), so they get a synthetic clock instead:
it starts at ``T0`` and each step record that advances the run moves it by the step's
``duration_ms`` (1 s when the log prints no step time) times the number of steps since the
run's previous highest step (logs print every n-th step; Megatron's time is per iteration).
Other records take the clock as it is.

``AlertEngine.tick()`` runs after every record with no wall clock (``now=None``), so the
tick rules (``stalled``, ``rank_mismatch``) judge on record time while the log lasts.

The end of a log
----------------
Where a log ends says different things. A log that ends with a run end (the parsers emit
one on "training completed" markers, a final validation, or a traceback / NCCL watchdog
timeout / kill with its reason) says how the run ended, and the engine forgets the run. A
log without one either stopped because the job stopped writing (it hangs, or died without
a word: ``megatron-deepspeed-v100-2node-log-stops-iter8.log``), or because the person who
posted it cut it there (an issue excerpt: the job went on). The records alone cannot tell
the two apart, and a live follower cannot either until time passes: that passing time is
what the ``stalled`` rule judges. So the replay simulates it only where the file itself is
the whole of what the job wrote: for the logs of ``COMPLETE_LOGS`` (PROVENANCE.md: "the
whole file", "to the end of the file" of the job's own log) one more tick runs with the
wall clock ``SILENCE_S`` (1 h) after the last record, exactly what ``trainmon ingest
--follow`` and the service would do while the job stays silent. Excerpts get no such tick:
their end is where someone stopped copying, and calling that a stall would be calling every
cut-off healthy excerpt a hang (``nemo-v2-bionemo-esm2-healthy.log``, iterations 120-125 of
149, ends that way).
"""

from __future__ import annotations

import functools
import logging
import math
import random
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainmon.consumers.alerts import AlertEngine, load_config  # noqa: E402
from trainmon.consumers.alerts.engine import INPUT_KINDS  # noqa: E402
from trainmon.ingest import FormatNotDetected, Session  # noqa: E402
from trainmon.ingest.reader import read_file  # noqa: E402
from trainmon.schemas import EvalRecord, Record, RunRecord, StepRecord  # noqa: E402

UTC = timezone.utc
CORPUS = ROOT / "tests" / "data" / "logs"
T0 = datetime(2024, 1, 1, tzinfo=UTC)  # start of the synthetic clock
NO_TIME = datetime(2000, 1, 1, tzinfo=UTC)  # what the session stamps on lines without a time
INF = math.inf

# Which rules count as catching an incident of each labelled kind. A kind missing here, or
# with no rules, can only be missed.
KIND_RULES: dict[str, tuple[str, ...]] = {
    "nan": ("non_finite", "nan_iterations"),
    "grad_norm_spike": ("grad_spike", "exploding_grad", "grad_norm_beyond_clip"),
    "loss_scale_collapse": ("loss_scale_collapse",),
    "skipped_iterations": ("skipped_iterations",),
    "throughput_drop": ("throughput_drop", "iteration_time_spike", "straggler"),
    # A hang the NCCL watchdog ended shows in the records only as the failed run end, whose
    # reason says so ("NCCL watchdog timeout: ... ran for 600034 milliseconds"); one that is
    # still hanging shows as silence (stalled) or as ranks at different steps.
    "hang": ("stalled", "rank_mismatch", "run_failed"),
    "crash": ("run_failed", "stalled"),
    # A logged 0.0 is not always a zero loss: the HF Trainer prints 0.0 for an interval of
    # NaN losses (its logging_nan_inf_filter), and the parser says NaN where the grad norm
    # shows it (hf-trainer-modernbert-nan-gradnorm-zero-loss.log), which non_finite reports.
    "zero_loss": ("zero_loss", "frozen_loss", "non_finite"),
}

# Kinds labelled at the last step a run logged whose evidence comes after that step's line
# (the traceback, the watchdog's timeout): in the mid-run variant, such an incident at the
# last step of the dropped half is still in the kept half.
AFTER_ITS_STEP = frozenset({"crash", "hang"})

# The logs whose last line is the last line the job wrote (PROVENANCE.md: "the whole file",
# "to the end of the file" of the job's own log). After their last record the job wrote
# nothing more, so the replay lets SILENCE_S of wall clock pass after it. Every other log is
# an excerpt (of an issue, a PR, a page): the job went on writing after its last line, and
# a silence after it would be an artifact of the excerpt, so none is simulated.
COMPLETE_LOGS = frozenset({
    "nanogpt-shakespeare-char-nan-loss.log",
    "nanogpt-tinystories-50m-healthy.log",
    "megatron-deepspeed-qwen25-7b-finetune-gradnorm.log",
    "megatron-deepspeed-v100-2node-log-stops-iter8.log",
    "megatron-deepspeed-2node-dataset-missing-traceback-nccl-watchdog.log",
    "torchtitan-kimik3-probe-cp2-20steps-healthy.log",
    "hf-trainer-swift-gemma4-full-epoch-tail.log",
    "modded-nanogpt-valueembed-record-train-loss-healthy.log",
    "modded-nanogpt-bias-experiment-h100-pcie-healthy.log",
    "modded-nanogpt-baseline-2026-batch-schedule-healthy.log",
})
SILENCE_S = 3600.0  # wall clock after a complete log's last record

TARGET_RECALL = 0.95
TARGET_DELAY = 1
TARGET_MID_RUN_RECALL = 0.90


# -- scoring (pure: no engine, no files) ---------------------------------------------------

@dataclass(frozen=True)
class Incident:
    kind: str
    first_step: int | None = None  # None: the label gives no steps, the incident spans the log
    last_step: int | None = None

    def describe(self) -> str:
        if self.first_step is None:
            return f"{self.kind}, whole log"
        if self.last_step in (None, self.first_step):
            return f"{self.kind}, step {self.first_step}"
        return f"{self.kind}, steps {self.first_step}-{self.last_step}"


@dataclass(frozen=True)
class Alert:
    """A firing alert, as much of it as the scoring needs."""
    rule: str
    severity: str
    step: int | None
    rank: int = 0

    def describe(self) -> str:
        where = "no step" if self.step is None else f"step {self.step}"
        return f"{self.rule} at {where} (rank {self.rank}, {self.severity})"


@dataclass
class Catch:
    incident: Incident
    alert: Alert | None = None  # None: missed
    delay: int | None = None  # logged step records from the onset to the alert


@dataclass
class LogScore:
    name: str
    healthy: bool
    catches: list[Catch]
    outside: list[Alert]  # firing alerts outside every incident's window
    inside_other: list[Alert] = field(default_factory=list)  # inside a window, caught nothing

    @property
    def false_alerts(self) -> list[Alert]:
        return [a for a in self.outside if a.severity != "info"]


def steps_of(rank: int, logged: dict[int, list[int]]) -> list[int]:
    """The sorted steps logged by ``rank`` (all ranks' if it logged none)."""
    if rank in logged:
        return logged[rank]
    return sorted({s for steps in logged.values() for s in steps})


def window(incident: Incident, steps: list[int]) -> tuple[float, float]:
    """Steps at which an alert counts for ``incident``: its first step to its last plus one
    more logged record; the whole log when the label gives no steps."""
    if incident.first_step is None:
        return -INF, INF
    last = incident.first_step if incident.last_step is None else incident.last_step
    later = [s for s in steps if s > last]
    return incident.first_step, (later[0] if later else last)


def in_window(alert: Alert, incident: Incident, logged: dict[int, list[int]]) -> bool:
    lo, hi = window(incident, steps_of(alert.rank, logged))
    if alert.step is None:
        return lo == -INF and hi == INF
    return lo <= alert.step <= hi


def delay(alert: Alert, incident: Incident, logged: dict[int, list[int]]) -> int:
    """Step records of the alert's rank from the incident's first step (or the start of the
    log) up to, not including, the alert's step."""
    if alert.step is None:
        return 0
    lo = -INF if incident.first_step is None else incident.first_step
    return sum(1 for s in steps_of(alert.rank, logged) if lo <= s < alert.step)


def score_log(name: str, incidents: list[Incident], alerts: list[Alert],
              logged: dict[int, list[int]], healthy: bool = False,
              kind_rules: dict[str, tuple[str, ...]] = KIND_RULES) -> LogScore:
    """Match firing ``alerts`` (in the order they fired) with the labelled ``incidents``;
    ``logged`` is the steps each rank logged, sorted."""
    catches, catching = [], set()
    for incident in incidents:
        rules = kind_rules.get(incident.kind, ())
        first = next((a for a in alerts if a.rule in rules and in_window(a, incident, logged)), None)
        if first is None:
            catches.append(Catch(incident))
        else:
            catching.add(id(first))
            catches.append(Catch(incident, first, delay(first, incident, logged)))
    outside, inside_other = [], []
    for a in alerts:
        if not any(in_window(a, i, logged) for i in incidents):
            outside.append(a)
        elif id(a) not in catching:
            inside_other.append(a)
    return LogScore(name, healthy, catches, outside, inside_other)


@dataclass
class Totals:
    incidents: int = 0
    caught: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [caught, labelled]
    delays: list[int] = field(default_factory=list)
    false_healthy: int = 0  # on healthy real runs
    false_elsewhere: int = 0  # outside the incidents of unhealthy real runs
    false_synthetic: int = 0
    info: int = 0  # info alerts outside incidents, listed and not counted

    @property
    def recall(self) -> float:
        return self.caught / self.incidents if self.incidents else float("nan")

    @property
    def median_delay(self) -> float:
        return statistics.median(self.delays) if self.delays else float("nan")


def summarize(real: list[LogScore], synthetic: list[LogScore]) -> Totals:
    t = Totals()
    for score in real:
        for c in score.catches:
            t.incidents += 1
            counts = t.by_kind.setdefault(c.incident.kind, [0, 0])
            counts[1] += 1
            if c.alert is not None:
                t.caught += 1
                counts[0] += 1
                t.delays.append(c.delay)
        if score.healthy:
            t.false_healthy += len(score.false_alerts)
        else:
            t.false_elsewhere += len(score.false_alerts)
    t.false_synthetic = sum(len(s.false_alerts) for s in synthetic)
    t.info = sum(len(s.outside) - len(s.false_alerts) for s in real + synthetic)
    return t


def targets(t: Totals) -> list[tuple[str, bool, str]]:
    """(target, met, measured) for each of the issue's targets."""
    recall = t.recall
    return [
        (f"recall >= {TARGET_RECALL:.0%} of labelled incidents", recall >= TARGET_RECALL,
         f"{t.caught}/{t.incidents} = {recall:.0%}"),
        ("0 alerts on healthy real runs", t.false_healthy == 0, f"{t.false_healthy}"),
        ("0 alerts on synthetic healthy runs", t.false_synthetic == 0, f"{t.false_synthetic}"),
        (f"median detection delay <= {TARGET_DELAY} logged record after onset",
         t.median_delay <= TARGET_DELAY, f"{t.median_delay:g} (over {len(t.delays)} caught)"),
    ]


def mid_run_targets(t: Totals) -> list[tuple[str, bool, str]]:
    """(target, met, measured) for the mid-run variant: the incidents of the second halves
    caught, no alert on the second half of a healthy real log or synthetic run."""
    recall = t.recall
    return [
        (f"recall >= {TARGET_MID_RUN_RECALL:.0%} of the incidents in the second halves",
         recall >= TARGET_MID_RUN_RECALL, f"{t.caught}/{t.incidents} = {recall:.0%}"),
        ("0 alerts on the second halves of healthy real runs", t.false_healthy == 0,
         f"{t.false_healthy}"),
        ("0 alerts on the second halves of synthetic healthy runs", t.false_synthetic == 0,
         f"{t.false_synthetic}"),
    ]


# -- the engine, in memory ------------------------------------------------------------------

def run_engine(records: list[Record], silence_s: float | None = None) -> list[Alert]:
    """Firing alerts of a fresh engine with the shipped defaults, in the order they fired.
    Ticks after every record on record time only; with ``silence_s``, one more tick with the
    wall clock at the last record's time plus ``silence_s`` (see the module docstring)."""
    engine = AlertEngine(load_config(env={}))
    fired: list[Alert] = []

    def keep(alerts):
        fired.extend(Alert(a.rule, a.severity, a.step, a.rank) for a in alerts if a.state == "firing")

    for record in records:
        keep(engine.process(record))
        keep(engine.tick())
    keep(engine.tick())
    if silence_s is not None and records:
        last = max(r.time.timestamp() for r in records)
        keep(engine.tick(now=last + silence_s))
    return fired


def logged_steps(records: list[Record]) -> dict[int, list[int]]:
    out: dict[int, set[int]] = {}
    for r in records:
        if r.kind == "step":
            out.setdefault(r.rank, set()).add(r.step)
    return {rank: sorted(steps) for rank, steps in out.items()}


# -- the real-log corpus ----------------------------------------------------------------------

@dataclass
class Parsed:
    fmt: str | None
    records: list[Record]
    rejected: int


def parse_log(path: Path, lines: list[str] | None = None) -> Parsed:
    """The records ``trainmon ingest`` would send for the log (or for ``lines`` of it), kinds
    the alerts read only, with the synthetic clock for lines without a timestamp."""
    records: list[Record] = []
    session = Session(path.stem, records.append, host="replay", clock=lambda: NO_TIME)
    for line in read_file(path) if lines is None else lines:
        session.feed(line)
    try:
        session.finish()
    except FormatNotDetected:
        pass
    kept = [r for r in records if r.kind in INPUT_KINDS]
    return Parsed(session.format, with_synthetic_clock(kept), sum(session.rejected.values()))


def with_synthetic_clock(records: list[Record]) -> list[Record]:
    """Records stamped NO_TIME get the synthetic clock; timestamped ones keep their time and
    set the clock. In a log whose steps carry no time, a record that does (a warning dated
    by the launcher's last timestamped line) gets the synthetic clock too: its time and the
    synthetic one are not comparable, and live (``--follow``) they would be the same."""
    timed_steps = any(r.kind == "step" and r.time != NO_TIME for r in records)
    clock, top, out = T0.timestamp(), None, []
    for r in records:
        advances = r.kind == "step" and (top is None or r.step > top)
        if r.time != NO_TIME and (timed_steps or r.kind == "step"):
            clock = r.time.timestamp()
        else:
            if advances:
                ms = r.duration_ms
                per_step = ms / 1000.0 if ms is not None and 0 < ms < INF else 1.0
                clock += per_step * (1 if top is None else r.step - top)
            r = r.model_copy(update={"time": datetime.fromtimestamp(clock, UTC)})
        if advances:
            top = r.step
        out.append(r)
    return out


def describe_parsed(parsed: Parsed, logged: dict[int, list[int]]) -> str:
    steps = sum(len(s) for s in logged.values())
    ranks = f" from rank(s) {', '.join(map(str, sorted(logged)))}" if logged else ""
    rejected = f", {parsed.rejected} records rejected by the schema" if parsed.rejected else ""
    return f"{parsed.fmt or 'no format'}: {steps} step records{ranks}{rejected}"


def label_incidents(label: dict) -> list[Incident]:
    return [Incident(i["kind"], i.get("first_step"), i.get("last_step"))
            for i in label.get("incidents") or []]


def score_corpus(mid_run: bool = False) -> tuple[list[LogScore], list[str], int]:
    """Per-log scores, a header line per log, and the records replayed. ``mid_run``: each log
    from its middle line on (the mid-run variant, see ``second_half``)."""
    labels = yaml.safe_load((CORPUS / "LABELS.yaml").read_text())
    scores, headers, n = [], [], 0
    for name, label in labels.items():
        incidents = label_incidents(label)
        if mid_run:
            lines = list(read_file(CORPUS / name))
            dropped = parse_log(CORPUS / name, lines[: len(lines) // 2])
            parsed = parse_log(CORPUS / name, lines[len(lines) // 2:])
            incidents = second_half(incidents, dropped.records, parsed.records)
        else:
            parsed = parse_log(CORPUS / name)
        logged = logged_steps(parsed.records)
        alerts = run_engine(parsed.records, SILENCE_S if name in COMPLETE_LOGS else None)
        scores.append(score_log(name, incidents, alerts, logged, healthy=bool(label.get("healthy"))))
        n += len(parsed.records)
        headers.append(describe_parsed(parsed, logged)
                       + ("; complete log: silence after it" if name in COMPLETE_LOGS else "; excerpt"))
    return scores, headers, n


def second_half(incidents: list[Incident], dropped: list[Record], kept: list[Record]) -> list[Incident]:
    """The incidents of a log replayed from its middle: those that go on past the last step the
    dropped first half logged (one labelled without steps spans the log, so both halves), each
    from the first step the kept half logged at the earliest. The replay knows nothing of the
    dropped half: it is what a follow started mid-run, or a restarted engine, would see."""
    cut = max((r.step for r in dropped if r.kind == "step"), default=-1)
    first_kept = min((r.step for r in kept if r.kind == "step" and r.step > cut), default=None)
    out = []
    for i in incidents:
        last = i.last_step if i.last_step is not None else i.first_step
        if i.first_step is None:
            out.append(i)
        elif last > cut or (last == cut and i.kind in AFTER_ITS_STEP):
            if first_kept is None:  # the kept half logs no step: the incident spans it
                out.append(Incident(i.kind))
            else:
                first = max(i.first_step, first_kept)
                out.append(Incident(i.kind, first, max(first, last)))
    return out


# -- synthetic healthy controls -------------------------------------------------------------

@dataclass(frozen=True)
class Control:
    name: str
    ranks: int
    steps: int
    schedule: str  # "cosine": warm-up then cosine to 10 %; "wsd": warm-up, stable, decay to 0
    seed: int
    fp16: bool = False  # dynamic loss scale from 2**16, skipped steps on overflow
    jitter: float = 0.03  # each rank's step time varies by +- this fraction
    checkpoint_every: int = 0  # that step is 10x slower
    eval_every: int = 0  # an eval inside that step (EVAL_STEPS steps' time longer)
    step_ms: float = 1200.0


EVAL_STEPS = 8  # an eval takes as long as this many training steps
CONTROLS = (
    Control("warm-up + cosine", ranks=1, steps=3000, schedule="cosine", seed=1),
    Control("WSD", ranks=4, steps=3000, schedule="wsd", seed=2, step_ms=900.0),
    Control("fp16 loss-scale warm-up, cosine", ranks=2, steps=2500, schedule="cosine", seed=3,
            fp16=True),
    Control("step time +-15 % jitter, WSD", ranks=8, steps=2000, schedule="wsd", seed=4,
            jitter=0.15, step_ms=2000.0),
    Control("checkpoint every 200, eval every 250, cosine", ranks=2, steps=3000,
            schedule="cosine", seed=5, checkpoint_every=200, eval_every=250, step_ms=600.0),
    Control("all of the above: WSD, fp16, jitter, checkpoints, evals", ranks=8, steps=2000,
            schedule="wsd", seed=6, fp16=True, jitter=0.15, checkpoint_every=200,
            eval_every=250, step_ms=1500.0),
)


def learning_rate(c: Control, s: int, peak: float = 3e-4) -> float:
    warmup = max(1, c.steps // 20)
    if s < warmup:
        return peak * (s + 1) / warmup
    if c.schedule == "cosine":
        progress = (s - warmup) / max(1, c.steps - warmup)
        return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
    decay_from = int(0.8 * c.steps)
    if s < decay_from:
        return peak
    return peak * (c.steps - 1 - s) / max(1, c.steps - 1 - decay_from)  # 0 at the last step


def mean_loss(c: Control, s: int) -> float:
    """A power law from ~11 (uniform over a large vocab) down; WSD drops more in its decay."""
    loss = 1.9 + 9.0 / math.sqrt(1 + s / 30)
    decay_from = int(0.8 * c.steps)
    if c.schedule == "wsd" and s > decay_from:
        loss -= 0.15 * (s - decay_from) / (c.steps - decay_from)
    return loss


def grad_norm(c: Control, s: int, rng: random.Random) -> float:
    """High in the first steps, then noisy around a slowly falling level, with an
    occasional benign bump of up to 2.5x."""
    level = 0.25 + 0.35 * (1 - s / c.steps) + 4.0 * math.exp(-s / 60)
    if rng.random() < 0.01:
        return level * rng.uniform(1.5, 2.5)
    return level * math.exp(rng.gauss(0.0, 0.2))


class LossScaler:
    """fp16 dynamic loss scale: halves on overflow (the step is skipped), doubles after
    1,000 clean steps. Overflows on the first few steps (the usual calibration), then about
    once per 1,000 steps."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.scale = float(2 ** 16)
        self.calibration = rng.randint(3, 5)
        self.clean = 0

    def step(self, s: int) -> bool:
        """True when step ``s`` overflowed (and was skipped)."""
        if s < self.calibration or self.rng.random() < 0.001:
            self.scale /= 2
            self.clean = 0
            return True
        self.clean += 1
        if self.clean >= 1000:
            self.scale *= 2
            self.clean = 0
        return False


def every(s: int, n: int) -> bool:
    return n > 0 and s > 0 and s % n == 0


def step_time_ms(c: Control, s: int) -> float:
    """Before jitter: the first step is 8x (compilation, warm-up), a checkpoint step 10x, and
    a step with an eval inside takes EVAL_STEPS steps' time longer."""
    ms = c.step_ms * (8.0 if s == 0 else 10.0 if every(s, c.checkpoint_every) else 1.0)
    return ms + (EVAL_STEPS * c.step_ms if every(s, c.eval_every) else 0.0)


@functools.lru_cache(maxsize=None)  # the mid-run variant replays the same runs' second halves
def synthetic_run(c: Control) -> list[Record]:
    """The records a healthy run of shape ``c`` would send, every rank logging every step."""
    rng = random.Random(c.seed)
    run_id = f"synthetic-{c.seed}"
    scaler = LossScaler(rng) if c.fp16 else None
    tokens = 4 * 2048
    t = T0.timestamp()

    def env(rank: int, kind: str, step: int) -> dict:
        return dict(run_id=run_id, rank=rank, world_size=c.ranks, host=f"node{rank // 8}",
                    time=datetime.fromtimestamp(t, UTC), event_id=f"{run_id}-{kind}-{rank}-{step}")

    out: list[Record] = [RunRecord(**env(r, "start", 0), event="start") for r in range(c.ranks)]
    for s in range(c.steps):
        skipped = scaler.step(s) if scaler else False
        norm = grad_norm(c, s, rng)
        base = step_time_ms(c, s)
        durations = [base * (1 + rng.uniform(-c.jitter, c.jitter)) for _ in range(c.ranks)]
        t += max(durations) / 1000.0  # ranks in lockstep: the step ends with its slowest rank
        for r in range(c.ranks):
            fields = dict(step=s, epoch=s / 1000, step_tokens=tokens, duration_ms=durations[r],
                          loss=None if skipped else mean_loss(c, s) * (1 + rng.gauss(0.0, 0.02)),
                          norm=None if skipped else norm, lr=learning_rate(c, s), total_steps=c.steps)
            if scaler:
                fields.update(loss_scale=scaler.scale, skipped=int(skipped))
            out.append(StepRecord(**env(r, "step", s), **fields))
        if every(s, c.eval_every):
            out += [EvalRecord(**env(r, "eval", s), step=s, eval_tokens=64 * 2048,
                               duration_ms=EVAL_STEPS * c.step_ms, loss=mean_loss(c, s) + 0.05)
                    for r in range(c.ranks)]
    t += 1.0
    out += [RunRecord(**env(r, "end", c.steps), event="end", status="success") for r in range(c.ranks)]
    return out


def score_controls(mid_run: bool = False) -> tuple[list[LogScore], int]:
    """The controls' scores and records replayed; ``mid_run``: each from its middle record
    on (a resumed run, a restarted engine)."""
    scores, n = [], 0
    for c in CONTROLS:
        records = [r for r in synthetic_run(c) if r.kind in INPUT_KINDS]
        if mid_run:
            records = records[len(records) // 2:]
        n += len(records)
        scores.append(score_log(f"{c.name} ({c.ranks} rank{'s' * (c.ranks > 1)}, {c.steps} steps)",
                                [], run_engine(records), logged_steps(records), healthy=True))
    return scores, n


# -- report ------------------------------------------------------------------------------------

def info_by_rule(alerts: list[Alert]) -> dict[str, list[str]]:
    """The info alerts among ``alerts``, their steps grouped by rule."""
    out: dict[str, list[str]] = {}
    for a in alerts:
        if a.severity == "info":
            out.setdefault(a.rule, []).append("?" if a.step is None else str(a.step))
    return out


def print_log(score: LogScore, header: str) -> None:
    status = "healthy" if score.healthy else f"{len(score.catches)} incident(s)"
    print(f"\n{score.name}\n  [{header}; {status}]")
    for c in score.catches:
        what = c.incident.describe()
        if c.alert is None:
            rules = ", ".join(KIND_RULES.get(c.incident.kind, ())) or "no rule for this kind"
            print(f"  MISSED  {what:<34} (rules that would count: {rules})")
        else:
            print(f"  caught  {what:<34} by {c.alert.describe()}, delay {c.delay}")
    for a in score.false_alerts:
        print(f"  FALSE   {a.describe()}")
    for rule, steps in info_by_rule(score.outside).items():
        print(textwrap.fill(f"info    {rule} x{len(steps)} at step(s) {', '.join(steps)} "
                            f"(info: listed, not counted as false alerts)",
                            width=100, initial_indent="  ", subsequent_indent=" " * 10))
    for a in score.inside_other:
        print(f"  other   {a.describe()} (inside an incident's window, not a rule for its kind)")
    if not score.catches and not score.outside and not score.inside_other:
        print("  no alerts")


def print_totals(t: Totals, title: str = "Totals") -> None:
    print(f"\n== {title}")
    print(f"recall: {t.caught}/{t.incidents} labelled incidents caught ({t.recall:.0%})")
    for kind, (caught, total) in sorted(t.by_kind.items()):
        rules = ", ".join(KIND_RULES.get(kind, ())) or "no rule watches for it"
        print(f"  {kind:<20} {caught}/{total}   (counted rules: {rules})")
    print("false alerts (warning or critical, outside every incident's window):")
    print(f"  on healthy real runs:            {t.false_healthy}")
    print(f"  elsewhere (unhealthy real logs): {t.false_elsewhere}")
    print(f"  on synthetic healthy runs:       {t.false_synthetic}")
    print(f"info alerts outside incidents (listed above, not counted as false alerts): {t.info}")
    delays = ", ".join(map(str, sorted(t.delays))) or "none"
    print(f"median detection delay: {t.median_delay:g} logged records after onset "
          f"(caught incidents' delays: {delays})")


def print_targets(t: Totals, title: str = "Targets", which=targets) -> None:
    print(f"\n== {title}")
    for what, met, measured in which(t):
        print(f"  {'met   ' if met else 'MISSED'}  {what}: {measured}")


def main() -> int:
    logging.getLogger("trainmon").setLevel(logging.ERROR)  # the parsers' per-format notes
    started = time.perf_counter()
    print("Alert quality: the real-log corpus (tests/data/logs) and synthetic healthy runs "
          "through the alerts engine, shipped default settings.")
    real, headers, n_real = score_corpus()
    print("\n== Real logs")
    for score, header in zip(real, headers):
        print_log(score, header)
    synthetic, n_synthetic = score_controls()
    print("\n== Synthetic healthy controls (0 alerts expected)")
    for score in synthetic:
        print_log(score, "synthetic")
    totals = summarize(real, synthetic)
    print_totals(totals)

    mid_real, mid_headers, _ = score_corpus(mid_run=True)
    print("\n== Mid-run: every log from its middle line on (the first half dropped, nothing "
          "else told), the synthetic runs from their middle record")
    for score, header in zip(mid_real, mid_headers):
        print_log(score, header)
    mid_synthetic, _ = score_controls(mid_run=True)
    for score in mid_synthetic:
        print_log(score, "synthetic, second half")
    mid_totals = summarize(mid_real, mid_synthetic)
    print_totals(mid_totals, "Mid-run totals (incidents of the second halves)")

    print_targets(totals)
    print_targets(mid_totals, "Mid-run targets", mid_run_targets)
    print(f"\n{len(real)} logs ({n_real:,} records) and {len(synthetic)} synthetic runs "
          f"({n_synthetic:,} records), whole and from their middle, in "
          f"{time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
