"""``trainmon goodput [JOB]``: where a training job's wall time went, as a table.

Reads the ClickHouse views ``goodput`` and ``goodput_daily`` (the classification is
theirs: trainmon/consumers/clickhouse/goodput.py, docs/goodput.md), so the command, the
report and the Grafana panel show the same numbers. JOB is a job id (``TRAINMON_JOB_ID``,
the Slurm job id, ...) or the id of one of its runs; default: the job of the run seen last.
"""

from __future__ import annotations

import argparse
import json
import sys

from .consumers.clickhouse.cli import query
from .consumers.clickhouse.client import Target
from .consumers.clickhouse.goodput import CATEGORIES, LABELS


def sql_string(value: str) -> str:
    """A ClickHouse string literal (a job id is the user's text)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _rows(target: Target, sql: str) -> list[dict]:
    out = query(target, sql, "JSONEachRow").decode()
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def job_of(target: Target, job_or_run: str) -> str | None:
    """The job ``job_or_run`` names: itself when a job has that id, else the job of the
    run with that id; None when neither is known."""
    found = _rows(target, f"SELECT job_id FROM trainmon.job_runs WHERE job_id = {sql_string(job_or_run)} "
                          f"OR run_id = {sql_string(job_or_run)} "
                          f"ORDER BY job_id = {sql_string(job_or_run)} DESC LIMIT 1")
    return found[0]["job_id"] if found else None


def job_of_run(target: Target, run_id: str) -> str | None:
    found = _rows(target, f"SELECT job_id FROM trainmon.job_runs WHERE run_id = {sql_string(run_id)}")
    return found[0]["job_id"] if found else None


def html_section(target: Target, run_id: str) -> str:
    """The report's section: the breakdown of the job ``run_id`` belongs to ('' when none)."""
    import html

    job_id = job_of_run(target, run_id)
    row = breakdown(target, job_id) if job_id is not None else None
    if row is None:
        return ""
    cells = "".join(f"<tr><td>{html.escape(label)}</td><td>{seconds:.1f}</td><td>{clock(seconds)}</td>"
                    f"<td>{part}</td></tr>" for label, seconds, part in table_lines(row))
    return (f"<h2>Goodput of job {html.escape(job_id)}: "
            f"{share(float(row['productive_s']), float(row['wall_s']))}</h2>"
            f"<p>{row['runs']} run(s) of the job, {html.escape(moment(row['started_at']))} to "
            f"{html.escape(moment(row['ended_at']))} UTC; the definitions: docs/goodput.md.</p>"
            f"<table class='goodput'><tr><th>time</th><th>seconds</th><th>h:mm:ss</th><th>share</th></tr>"
            f"{cells}</table>")


def newest_job(target: Target) -> str | None:
    found = _rows(target, "SELECT j.job_id AS job_id FROM trainmon.run_overview AS r "
                          "INNER JOIN trainmon.job_runs AS j ON j.run_id = r.run_id "
                          "ORDER BY r.last_seen_at DESC LIMIT 1")
    return found[0]["job_id"] if found else None


def breakdown(target: Target, job_id: str) -> dict | None:
    """The job's row of the ``goodput`` view (seconds per category, wall_s, goodput)."""
    found = _rows(target, f"SELECT * FROM trainmon.goodput WHERE job_id = {sql_string(job_id)}")
    return found[0] if found else None


def daily(target: Target, job_id: str) -> list[dict]:
    return _rows(target, f"SELECT * FROM trainmon.goodput_daily WHERE job_id = {sql_string(job_id)} "
                         "ORDER BY day")


def moment(value: object) -> str:
    """'2026-03-01 23:50:00.000000' -> '2026-03-01 23:50:00' (to the second)."""
    return str(value)[:19]


def clock(seconds: float) -> str:
    """1234.5 -> '0:20:34' (h:mm:ss, rounded to the second)."""
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def share(part: float, wall: float) -> str:
    return f"{100 * part / wall:.1f} %" if wall > 0 else "-"


def table_lines(row: dict) -> list[tuple[str, float, str]]:
    """(what, seconds, share of the wall time) per category, then the wall time."""
    wall = float(row["wall_s"])
    out = [(LABELS[c], float(row[f"{c}_s"]), share(float(row[f"{c}_s"]), wall)) for c in CATEGORIES]
    out.append(("wall time", wall, share(wall, wall)))
    return out


def format_breakdown(row: dict) -> str:
    lines = [f"job {row['job_id']}: {row['runs']} run(s), {moment(row['started_at'])} -> "
             f"{moment(row['ended_at'])} UTC"]
    width = max(len(label) for label, _, _ in table_lines(row))
    lines.append(f"{'':{width}}  {'seconds':>12}  {'h:mm:ss':>10}  {'share':>7}")
    for label, seconds, part in table_lines(row):
        lines.append(f"{label:{width}}  {seconds:12.1f}  {clock(seconds):>10}  {part:>7}")
    lines.append(f"goodput: {share(float(row['productive_s']), float(row['wall_s']))}")
    return "\n".join(lines)


def format_daily(days: list[dict]) -> str:
    head = ["day", *CATEGORIES, "wall", "goodput"]
    body = [[d["day"], *(f"{float(d[f'{c}_s']):.0f}" for c in CATEGORIES), f"{float(d['wall_s']):.0f}",
             share(float(d["productive_s"]), float(d["wall_s"]))] for d in days]
    widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(str(v).rjust(w) for v, w in zip(r, widths)) for r in [head, *body])


def main(argv: list[str] | None = None) -> int:
    from .consumers.clickhouse.service import add_target_arguments, target_from

    parser = argparse.ArgumentParser(prog="trainmon goodput", description=__doc__.splitlines()[0])
    parser.add_argument("job", nargs="?", help="a job id or a run id (default: the job of the run seen last)")
    parser.add_argument("--daily", action="store_true", help="also the breakdown per UTC day, in seconds")
    add_target_arguments(parser)
    args = parser.parse_args(argv)
    target = target_from(args)
    job_id = job_of(target, args.job) if args.job else newest_job(target)
    if job_id is None:
        print(f"trainmon goodput: no job or run {args.job!r} in ClickHouse" if args.job else
              "trainmon goodput: no run in ClickHouse yet", file=sys.stderr)
        return 1
    row = breakdown(target, job_id)
    if row is None:
        print(f"trainmon goodput: job {job_id!r} has no records to measure", file=sys.stderr)
        return 1
    print(format_breakdown(row))
    if args.daily:
        print()
        print(format_daily(daily(target, job_id)))
    return 0
