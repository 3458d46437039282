"""``trainmon consume wandb``: mirror the record streams into Weights & Biases.

One W&B run per trainmon run, its id derived from the run id (so a restarted forwarder
resumes the same W&B run). Project / entity / name come from WANDB_PROJECT,
WANDB_ENTITY, WANDB_NAME, else the run's own project / name, else "trainmon" / the
run id; WANDB_MODE=offline and WANDB_DIR work as usual.

Names are Surogate's: train/loss, gpu/clock, ... for rank 0, ``rank{r}/...`` for the
other ranks. Every chart's x axis is the training step: W&B's own ``_step`` must only
grow, but records of different topics and ranks arrive interleaved, so each row also
carries a ``step`` value and every metric is defined against it (``define_metric``).
The allocator breakdown is logged as a pie chart image (``allocator/breakdown``) next to
the per-segment allocator/{segment}_mib scalars; the run config is synced at start.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import time
from pathlib import Path

from ..schemas import AllocatorRecord
from .forwarding import RunWork, arg_parser, forward, require
from .metric_names import allocator_breakdown, scalars

log = logging.getLogger("trainmon.forwarders.wandb")
STATE_DIR = ".trainmon-forwarder"
STEP_KEY = "step"


def wandb_run_id(run_id: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id):
        return run_id
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "_", run_id)[:48].strip("_") or "run"
    return f"{cleaned}-{hashlib.sha1(run_id.encode()).hexdigest()[:10]}"


class WandbSink:
    """Runs mirrored into W&B: a forwarding.ExperimentTracker, which ForwardingSink
    drives on the consumer runtime."""

    name = "wandb"
    # W&B fixes a run's project when the run is made: a new run's points wait this long for
    # its start record (another topic, so maybe a batch later) before it is made without.
    start_wait_s = 15.0
    # A run's end (rank 0's run_end, on a topic of its own) may come in a batch before other
    # ranks' last points: a run is finished once nothing came for this long after its end,
    # not at once, or their points would reopen it (offline, a second run file).
    end_grace_s = 15.0

    def __init__(self, *, directory: str | Path = ".", mode: str | None = None, project: str | None = None,
                 entity: str | None = None, run_name: str | None = None, barrier_timeout: float = 120.0):
        self._wandb = require("wandb", "wandb")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.mode = mode
        self.project = project
        self.entity = entity
        self.run_name = run_name
        self.barrier_timeout = barrier_timeout
        self._runs: dict[str, list] = {}  # run_id -> [wandb Run, last used]
        self._dirty: set[str] = set()
        self._last_pie: dict[str, dict[int, list]] = {}  # run_id -> rank -> last breakdown

    def _settings(self):
        return self._wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True,
                                    save_code=False, x_save_requirements=False, disable_job_creation=True)

    def _run(self, work: RunWork):
        entry = self._runs.get(work.run_id)
        if entry is None:
            # The start's names, also where its record came in an earlier batch: a run made
            # again (finished, then points came; a restarted forwarder) stays where it was.
            started_as = work.started_as
            run = self._wandb.init(
                id=wandb_run_id(work.run_id), resume="allow", reinit="create_new",
                project=self.project or started_as.get("project") or "trainmon",
                entity=self.entity, name=self.run_name or started_as.get("name") or work.run_id,
                dir=str(self.directory), mode=self.mode, config=work.progress.config,
                settings=self._settings())
            run.define_metric(STEP_KEY)
            run.define_metric("*", step_metric=STEP_KEY)
            entry = self._runs[work.run_id] = [run, 0.0, None]  # (run, last used, exit code once ended)
        elif work.start is not None and work.start.name and not self.run_name:
            entry[0].name = work.start.name
        entry[1] = time.monotonic()
        return entry

    def write(self, work: RunWork) -> None:
        entry = self._run(work)
        run = entry[0]
        if work.config is not None:
            run.config.update(work.config, allow_val_change=True)
        rows: dict[int, dict] = {}
        for record in work.records:
            row = rows.setdefault(record.step, {STEP_KEY: record.step})
            for scalar in scalars(record):
                row[scalar.flat_name(record.rank)] = scalar.value
            if isinstance(record, AllocatorRecord):
                self._add_pie(work.run_id, record, row)
        for step in sorted(rows):
            run.log(rows[step])
        if rows:
            self._dirty.add(work.run_id)
        if work.ended is not None:
            entry[2] = 0 if work.ended == "success" else 1  # (finished after end_grace_s: close_idle)

    def _add_pie(self, run_id: str, record: AllocatorRecord, row: dict) -> None:
        """A pie chart of the breakdown, when it changed since the last one of this rank."""
        breakdown = allocator_breakdown(record)
        last = self._last_pie.setdefault(run_id, {})
        if not breakdown or last.get(record.rank) == breakdown:
            return
        last[record.rank] = breakdown
        key = "allocator/breakdown" if record.rank == 0 else f"rank{record.rank}/allocator/breakdown"
        row[key] = pie_chart(self._wandb, breakdown, f"GPU allocations, rank {record.rank}, step {record.step}")

    def flush(self) -> None:
        # W&B writes asynchronously through its wandb-core service. A summary read is a
        # round trip through the same ordered stream, so once the summary's _step (W&B's
        # row counter) is the last row logged, every row has reached wandb-core.
        for run_id in self._dirty:
            entry = self._runs.get(run_id)
            if entry is not None:
                self._barrier(entry[0])
        self._dirty.clear()

    def _barrier(self, run) -> None:
        deadline = time.monotonic() + self.barrier_timeout
        while run.summary.get("_step") != run.step - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"W&B run {run.id} did not confirm row {run.step - 1} "
                                   f"within {self.barrier_timeout:.0f} s")
            time.sleep(0.02)

    def close_idle(self, idle_seconds: float) -> None:
        now = time.monotonic()
        for run_id in [r for r, entry in self._runs.items()
                       if now - entry[1] > (idle_seconds if entry[2] is None else min(idle_seconds, self.end_grace_s))]:
            self._finish(run_id)

    def _finish(self, run_id: str) -> None:
        entry = self._runs.pop(run_id, None)
        self._dirty.discard(run_id)
        self._last_pie.pop(run_id, None)
        if entry is not None:
            entry[0].finish(exit_code=entry[2] or 0)  # waits until the run's data is written

    def close(self) -> None:
        self.flush()
        for run_id in list(self._runs):
            self._finish(run_id)


def pie_chart(wandb, breakdown: list[tuple[str, float]], title: str):
    """A pie chart image (matplotlib, no display needed); a table when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        return wandb.Table(columns=["segment", "device_mib"], data=[list(p) for p in breakdown])
    figure = Figure(figsize=(5, 4), dpi=80)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.pie([mib for _, mib in breakdown], labels=[f"{name}\n{mib:,.0f} MiB" for name, mib in breakdown],
             autopct="%1.0f%%", startangle=90, counterclock=False)
    axes.set_title(title)
    png = io.BytesIO()
    figure.savefig(png, format="png")
    png.seek(0)
    from PIL import Image  # matplotlib's own dependency

    return wandb.Image(Image.open(png), caption=title)


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser("wandb", __doc__.splitlines()[0])
    args = parser.parse_args(argv)

    def make_tracker():
        sink = WandbSink(directory=os.environ.get("WANDB_DIR") or ".", mode=os.environ.get("WANDB_MODE"),
                         project=os.environ.get("WANDB_PROJECT"), entity=os.environ.get("WANDB_ENTITY"),
                         run_name=os.environ.get("WANDB_NAME"))
        return sink, sink.directory / STATE_DIR

    return forward(args, make_tracker)
