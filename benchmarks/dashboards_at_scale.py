"""Every dashboard query over a 1,024-rank run of 10 million step rows.

Loads, through the project's own DDL (tables, materialized views), one run of 1,024
ranks x 9,800 steps (10,035,200 step rows, 2,007,040 GPU rows at one sample per 5 steps,
1,003,520 allocator rows at one per 10 steps) plus 50 small runs (8 ranks x 1,000 steps),
generated in SQL so loading takes a minute, not hours. Then runs every panel, annotation
and variable query of trainmon/grafana/dashboards with the ClickHouse plugin's macros
expanded, over the whole big run and over its last hour, with the interval Grafana would
pick for a panel 1,500 pixels wide, and prints per query the median and slowest latency
and the rows and the most points of one series it returned.

Targets (issue #14): every query <= 100 ms median and <= 500 ms at most, at most 2,000
points per series.

    python benchmarks/dashboards_at_scale.py [--ranks 1024 --steps 9800] [--repeat 5]
    python benchmarks/dashboards_at_scale.py --quick     # 64 ranks x 500 steps, a smoke run
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainmon.consumers.clickhouse import Target, connect, create_all, refresh_now  # noqa: E402
from trainmon.grafana_sql import ALL, TimeRange, dashboard_queries, expand, load_dashboards  # noqa: E402

BIG_RUN = "scale-1024"
MEDIAN_TARGET_MS, MAX_TARGET_MS, POINTS_TARGET = 100.0, 500.0, 2_000
PANEL_PIXELS = 1_500  # Grafana's maxDataPoints defaults to the panel's width
NICE_INTERVALS_S = (1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600)


def grafana_interval(seconds: float) -> int:
    """The interval Grafana's ClickHouse panels get: range / max data points, rounded up
    to a round number of seconds."""
    raw = seconds / PANEL_PIXELS
    return next((n for n in NICE_INTERVALS_S if n >= raw), NICE_INTERVALS_S[-1])


def load(client, ranks: int, steps: int, start: datetime, small_runs: int = 50) -> dict[str, int]:
    """Generate the runs in ClickHouse itself (INSERT ... SELECT FROM numbers)."""
    create_all(client)
    t0 = start.strftime("%Y-%m-%d %H:%M:%S")
    chunk = 1_000_000

    def insert(table: str, columns: str, select: str, total: int, where: str = "1") -> None:
        for first in range(0, total, chunk):
            n = min(chunk, total - first)
            client.command(f"INSERT INTO trainmon.{table} ({columns}) SELECT {select} "
                           f"FROM (SELECT number + {first} AS number FROM numbers({n})) WHERE {where}")

    envelope = "run_id, rank, world_size, host, time, event_id, schema_version, step"

    def envelope_values(run_id: str, world: int, t_start: str, every: int) -> str:
        """The envelope of row ``number``: rank number % world, one sample per ``every``
        steps, step i about i seconds in (jitter: cityHash of the row number)."""
        step = f"(intDiv(number, {world}) * {every})"
        return (f"'{run_id}', number % {world} AS r, {world}, concat('node-', toString(intDiv(r, 8))), "
                f"toDateTime64('{t_start}', 6, 'UTC') + toIntervalMillisecond({step} * 1000 "
                f"+ cityHash64(number) % 200), concat('{run_id}-', toString(number)), 1, {step} AS s")

    def run(run_id: str, world: int, n_steps: int, t_start: str) -> None:
        # Rank 17 is 20 % slower from the middle on; rank 5 stops at 90 %.
        insert("step", envelope + ", epoch, step_tokens, duration_ms, loss, norm, lr, tokens_per_second, "
               "total_steps, loss_scale, params_norm, num_zeros, tflops_per_gpu, sol_percent, timers, "
               "_topic, _partition, _offset",
               envelope_values(run_id, world, t_start, 1) + f", s / {n_steps}, 4096, "
               f"if(r = 17 AND s > {n_steps // 2}, 1200, 1000) + cityHash64(number, 1) % 50 AS ms, "
               f"4 * exp(-s / {n_steps}) + (cityHash64(number, 2) % 100) / 1000, "
               f"1 + (cityHash64(number, 3) % 100) / 100, 3e-4, 4096 * 1000 / ms, {n_steps * 2}, "
               "1, 300, 0, 400, 40, map('forward', ms * 0.4, 'backward', ms * 0.55), "
               "'trainmon.step', 0, number",
               world * n_steps, where=f"NOT (r = 5 AND s > {n_steps * 9 // 10})")
        insert("gpu", envelope + ", id, clock, max_clock, power, power_limit, temperature, temp_slowdown, "
               "gpu_util, mem_util, dram_free, pcie_rx, pcie_tx, fan, throttle, energy, "
               "_topic, _partition, _offset",
               envelope_values(run_id, world, t_start, 5)
               + ", r % 8, 1755, 1980, 600000 + cityHash64(number) % 100000, 700000, "
               "60 + cityHash64(number, 1) % 20, 87, 95, 40, 10737418240, 1000000, 2000000, 0, "
               "if(cityHash64(number, 2) % 1000 = 0, 'sw_power_cap', ''), 1000000000 + number, "
               "'trainmon.gpu', 0, number",
               world * (n_steps // 5))
        insert("allocator", envelope + ", `stats.name`, `stats.device`, `stats.managed`, `stats.pinned`, "
               "`stats.pageable`, allocated, peak_allocated, active, inactive, reserved, alloc_retries, "
               "_topic, _partition, _offset",
               envelope_values(run_id, world, t_start, 10)
               + ", ['weights', 'gradients', 'optimizer', 'activations'], "
               "[1073741824, 1073741824, 2147483648, 3221225472], [0, 0, 0, 0], [0, 0, 0, 0], "
               "[4096, 4096, 4096, 4096], 7516192768, 9663676416, 7516192768, 1048576, 10737418240, 0, "
               "'trainmon.allocator', 0, number",
               world * (n_steps // 10))
        client.command(
            "INSERT INTO trainmon.run (run_id, rank, world_size, host, time, event_id, event, status, "
            f"name, project, config) VALUES ('{run_id}', 0, {world}, 'node-0', "
            f"toDateTime64('{t_start}', 6, 'UTC'), '{run_id}-start', 'start', 'running', '{run_id}', "
            "'scale', '{}')")

    run(BIG_RUN, ranks, steps, t0)
    small_start = start - timedelta(days=2)
    for i in range(small_runs):
        run(f"small-{i:02d}", 8, 1_000, (small_start + timedelta(minutes=20 * i)).strftime("%Y-%m-%d %H:%M:%S"))
    client.command(
        "INSERT INTO trainmon.alert (run_id, rank, world_size, host, time, event_id, ranks, rule, severity, "
        "state, incident_id, step, value, threshold, message) VALUES "
        f"('{BIG_RUN}', 0, {ranks}, 'node-0', toDateTime64('{t0}', 6, 'UTC') + toIntervalSecond({steps // 2 + 30}), "
        f"'a1', [17], 'straggler', 'warning', 'firing', 'inc-1', {steps // 2 + 30}, 1.2, 1.15, "
        f"'rank 17 is 1.2x slower than the median of {ranks} ranks')")
    counts = {}
    for table in ("step", "gpu", "allocator", "run", "alert"):
        counts[table] = client.query(f"SELECT count() FROM trainmon.{table}").result_rows[0][0]
    return counts


def loaded_start(client) -> datetime | None:
    """When the big run of an earlier --data-dir load started (None: nothing loaded)."""
    exists = client.query("SELECT count() FROM system.tables WHERE database = 'trainmon' "
                          "AND name = 'run'").result_rows[0][0]
    if not exists:
        return None
    rows = client.query(f"SELECT min(time) FROM trainmon.run WHERE run_id = '{BIG_RUN}'").result_rows
    first = rows[0][0] if rows else None
    return None if first is None or first.year < 2000 else first.replace(tzinfo=timezone.utc)


def series_shape(result) -> tuple[int, int]:
    """(series, most points of one series) of a time-series result: rows per distinct
    label; (0, 0) for a table."""
    names = list(result.column_names)
    if "time" not in names:
        return 0, 0
    label = names.index("series") if "series" in names else None
    per_series = Counter(row[label] if label is not None else None for row in result.result_rows)
    return len(per_series), max(per_series.values(), default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=9800)
    p.add_argument("--repeat", type=int, default=5, help="runs of each query (median of these)")
    p.add_argument("--quick", action="store_true", help="64 ranks x 500 steps, 3 repeats")
    p.add_argument("--data-dir", help="chDB directory (default: a temporary one)")
    p.add_argument("--only", help="run only queries whose name contains this")
    args = p.parse_args(argv)
    if args.quick:
        args.ranks, args.steps, args.repeat = 64, 500, 3
    with tempfile.TemporaryDirectory(prefix="trainmon-dash-") as tmp:
        client = connect(Target(path=args.data_dir or str(Path(tmp) / "chdb")))
        start = loaded_start(client)
        if start is None:
            start = (datetime.now(timezone.utc) - timedelta(seconds=args.steps + 60)).replace(microsecond=0)
            began = time.perf_counter()
            counts = load(client, args.ranks, args.steps, start)
            print(f"loaded in {time.perf_counter() - began:.0f} s: "
                  + ", ".join(f"{n:,} {t} rows" for t, n in counts.items()), flush=True)
        else:
            create_all(client)  # the tables and views of this version over the data kept
            print(f"reusing the run loaded in {args.data_dir} (started {start:%Y-%m-%d %H:%M})", flush=True)
        refresh_now(client)  # (the goodput panel's table, else recomputed within a minute)
        client.database = "trainmon"  # as the data source's defaultDatabase does
        end = start + timedelta(seconds=args.steps + 60)
        ranges = {"whole run": TimeRange(start - timedelta(minutes=1), end,
                                         grafana_interval(args.steps + 120)),
                  "last hour": TimeRange(end - timedelta(hours=1), end, grafana_interval(3600))}
        queries = {}
        for dashboard in load_dashboards(REPO / "trainmon" / "grafana" / "dashboards"):
            for q in dashboard_queries(dashboard):
                for range_name, time_range in ranges.items():
                    name = f"{q.dashboard.removeprefix('trainmon / ')} / {q.panel} / {q.ref_id} / {range_name}"
                    if args.only and args.only not in name:
                        continue
                    queries[name] = expand(q.sql, time_range, {"run_id": BIG_RUN, "rank": ALL})
        print(f"{len(queries)} queries ({args.ranks} ranks, {args.steps} steps); "
              f"intervals: " + ", ".join(f"{k} {v.interval_s} s" for k, v in ranges.items()), flush=True)
        rows = []
        for name, sql in queries.items():
            timings, result = [], None
            try:
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    result = client.query(sql)
                    timings.append((time.perf_counter() - t) * 1000)
            except Exception as exc:  # noqa: BLE001 - a broken panel is reported, not fatal
                print(f"FAILED {name}: {str(exc).splitlines()[0][:300]}", flush=True)
                rows.append((name, math.inf, math.inf, 0, 0, 0))
                continue
            rows.append((name, statistics.median(timings), max(timings), len(result.result_rows),
                         *series_shape(result)))
        width = max(len(r[0]) for r in rows)
        print(f"\n{'query':<{width}}  {'median ms':>9}  {'max ms':>7}  {'rows':>7}  {'series':>6}  "
              f"{'pts/series':>10}")
        for name, median, slowest, n_rows, n_series, points in rows:
            flag = "  <-- over target" if median > MEDIAN_TARGET_MS or slowest > MAX_TARGET_MS \
                or points > POINTS_TARGET else ""
            print(f"{name:<{width}}  {median:9.1f}  {slowest:7.1f}  {n_rows:7d}  {n_series:6d}  {points:10d}{flag}")
        medians = sorted(r[1] for r in rows)
        worst_median = max(rows, key=lambda r: r[1])
        worst_max = max(rows, key=lambda r: r[2])
        worst_points = max(rows, key=lambda r: r[5])
        most_series = max(rows, key=lambda r: r[4])
        print(f"\nall queries: median of medians {statistics.median(medians):.1f} ms, "
              f"{sum(m > MEDIAN_TARGET_MS for m in medians)} of {len(rows)} over {MEDIAN_TARGET_MS:.0f} ms")
        verdict = lambda ok: "met" if ok else "MISSED"  # noqa: E731
        print(f"target: every query median <= {MEDIAN_TARGET_MS:.0f} ms: slowest median "
              f"{worst_median[1]:.1f} ms ({worst_median[0]}): {verdict(worst_median[1] <= MEDIAN_TARGET_MS)}")
        print(f"target: every query <= {MAX_TARGET_MS:.0f} ms at most: slowest run {worst_max[2]:.1f} ms "
              f"({worst_max[0]}): {verdict(worst_max[2] <= MAX_TARGET_MS)}")
        print(f"target: <= {POINTS_TARGET:,} points per series: most {worst_points[5]:,} "
              f"({worst_points[0]}): {verdict(worst_points[5] <= POINTS_TARGET)}")
        print(f"series per query (not a target: distribution plus standouts, not one per rank): "
              f"most {most_series[4]:,} ({most_series[0]})")
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
