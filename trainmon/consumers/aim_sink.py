"""``trainmon consume aim``: mirror the record streams into an Aim repository.

One Aim run per trainmon run in the repo at TRAINMON_AIM_REPO (experiment from
TRAINMON_AIM_EXPERIMENT, else the run's project, else "trainmon"). Metrics are tracked
as Surogate names them for Aim (train/loss, gpu/{id}/{metric}, allocator/{segment}_mib)
with context {"subset": "train" | "eval", "rank": r}. The run config goes to the run's
``hparams``; the trainmon run id to ``run["trainmon"]["run_id"]``, which is how a
restarted forwarder finds the Aim run again.

After each batch the forwarder indexes the runs it wrote, so ``aim.Repo`` queries and
the Aim UI see the data without waiting for ``aim up``'s own indexer.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from .forwarding import RunWork, arg_parser, forward, require
from .metric_names import scalars

log = logging.getLogger("trainmon.forwarders.aim")
STATE_DIR = ".trainmon-forwarder"


class AimSink:
    """Runs mirrored into an Aim repository: a forwarding.ExperimentTracker, which ForwardingSink
    drives on the consumer runtime."""

    name = "aim"

    def __init__(self, repo: str | Path, experiment: str | None = None):
        aim = require("aim", "aim")
        from aim.sdk.index_manager import RepoIndexManager

        self._Run = aim.Run
        self.path = Path(repo)
        self.path.mkdir(parents=True, exist_ok=True)
        self.repo = aim.Repo.from_path(str(self.path), init=True)
        self._indexer = RepoIndexManager.get_index_manager(self.repo)
        self.experiment = experiment
        self._runs: dict[str, tuple[object, float]] = {}  # run_id -> (aim Run, last used)
        self._touched: set[str] = set()  # Aim run hashes written since the last flush

    def _run(self, work: RunWork):
        entry = self._runs.get(work.run_id)
        if entry is None:
            run_hash = work.progress.sink.get("aim_run_hash") or self._find(work.run_id)
            if run_hash:
                run = self._Run(run_hash, repo=self.repo, system_tracking_interval=None,
                                capture_terminal_logs=False)
            else:
                project = work.start.project if work.start else None
                run = self._Run(repo=self.repo, experiment=self.experiment or project or "trainmon",
                                system_tracking_interval=None, capture_terminal_logs=False)
                run["trainmon"] = {"run_id": work.run_id}
                run.name = work.run_id
            entry = (run, 0.0)
        run = entry[0]
        work.progress.sink["aim_run_hash"] = run.hash
        self._runs[work.run_id] = (run, time.monotonic())
        self._touched.add(run.hash)
        return run

    def _find(self, run_id: str) -> str | None:
        """The Aim run of a trainmon run whose progress file is gone (or never got written)."""
        for run in self.repo.iter_runs():
            info = run.get("trainmon") or {}
            if info.get("run_id") == run_id:
                return run.hash
        return None

    def write(self, work: RunWork) -> None:
        run = self._run(work)
        if work.config is not None:
            run["hparams"] = work.config
            run["trainmon"] = {"run_id": work.run_id, **work.config.get("trainmon", {})}
        if work.start is not None:
            if work.start.name:
                run.name = work.start.name
            # The start (its own topic) can come a batch after the run's first metrics, when
            # the run was made under the default experiment: its project still names it.
            if not self.experiment and work.start.project and run.experiment != work.start.project:
                run.experiment = work.start.project
        for record in work.records:
            by_subset: dict[str, dict[str, float]] = {}
            for scalar in scalars(record):
                by_subset.setdefault(scalar.subset, {})[scalar.aim_name()] = scalar.value
            for subset, values in by_subset.items():  # one call per context: far cheaper
                run.track(values, step=record.step, context={"subset": subset, "rank": record.rank})
        if work.ended is not None:
            self._close(work.run_id)

    def flush(self) -> None:
        # Aim's writes go straight to RocksDB (its write-ahead log survives a crash of this
        # process); indexing makes them visible to Repo queries.
        for run_hash in self._touched:
            self._indexer.index(run_hash)
        self._touched.clear()

    def close_idle(self, idle_seconds: float) -> None:
        now = time.monotonic()
        for run_id in [r for r, (_, used) in self._runs.items() if now - used > idle_seconds]:
            self._close(run_id)
        if self._touched:
            self.flush()

    def _close(self, run_id: str) -> None:
        run, _ = self._runs.pop(run_id)
        run.close()
        self._touched.add(run.hash)  # index again: the end time is part of the run's meta

    def close(self) -> None:
        for run_id in list(self._runs):
            self._close(run_id)
        self.flush()


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser("aim", __doc__.splitlines()[0])
    parser.add_argument("--repo", default=os.environ.get("TRAINMON_AIM_REPO", "."),
                        help="Aim repository path (default: TRAINMON_AIM_REPO or the current directory)")
    parser.add_argument("--experiment", default=os.environ.get("TRAINMON_AIM_EXPERIMENT"),
                        help="Aim experiment (default: TRAINMON_AIM_EXPERIMENT, else the run's project)")
    args = parser.parse_args(argv)

    def make_tracker():
        sink = AimSink(args.repo, args.experiment)
        return sink, sink.path / STATE_DIR

    return forward(args, make_tracker)
