"""An HTML report of any run (matplotlib plots as inline PNGs, tables), from ClickHouse
with SQL as a user would query it: ``trainmon report [RUN_ID] [-o FILE]`` (newest run by
default; the ClickHouse target as for ``trainmon sql``: --path / --url or the
TRAINMON_CLICKHOUSE_* environment). One self-contained file, to open or attach.
"""

from __future__ import annotations

import base64
import html
import io
import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from .consumers.clickhouse.cli import query
from .consumers.clickhouse.client import Target
from .filenames import safe_name
from .goodput import html_section


def sql_string(value: str) -> str:
    """A ClickHouse string literal (a run id is the user's text)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def rows(target: Target, sql: str) -> list[dict]:
    out = query(target, sql, "JSONEachRow").decode()
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def alerts_of(target: Target, run_id: str) -> list[dict]:
    return rows(target, f"""
        SELECT rule, severity, state, ranks, step, value, threshold, message, incident_id
        FROM trainmon.alert FINAL WHERE run_id = {sql_string(run_id)} ORDER BY time, incident_id, state""")


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def _number(value) -> float:
    """A value of the query's JSON as a float: NaN / Inf come as the strings "nan", "inf"
    (OUTPUT_SETTINGS quote them), a NULL (not logged) as None, which becomes NaN: a gap."""
    return float(value) if value is not None else float("nan")


def _by_rank(data: list[dict], value: str) -> dict[int, tuple[list, list]]:
    """rank -> (steps, values); a NULL (not logged) becomes NaN, a gap in the line."""
    series: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
    for row in data:
        xs, ys = series[row["rank"]]
        xs.append(row["step"])
        ys.append(_number(row[value]))
    return series


def _plot_by_rank(ax, data: list[dict], value: str, log_scale: bool = False) -> None:
    """One line per rank; a metric no step logged says so instead of an empty chart."""
    series = _by_rank(data, value)
    finite = [y for _, ys in series.values() for y in ys if math.isfinite(y)]
    if not finite:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center",
                color="gray")
        return
    for rank, (xs, ys) in sorted(series.items()):
        ax.plot(xs, ys, label=f"rank {rank}", linewidth=1)
    if log_scale and any(y > 0 for y in finite):
        ax.set_yscale("log")


def _table(title: str, data: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in data[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape('' if v is None else str(v))}</td>"
                                    for v in row.values()) + "</tr>" for row in data)
    return f"<h2>{html.escape(title)}</h2><table><tr>{head}</tr>{body}</table>"


def write_report(target: Target, run_id: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = f"run_id = {sql_string(run_id)}"
    steps = rows(target, f"SELECT rank, step, loss, norm, lr, tokens_per_second, duration_ms "
                         f"FROM trainmon.step FINAL WHERE {run} ORDER BY rank, step")
    evals = rows(target, f"SELECT step, avg(loss) AS loss FROM trainmon.eval FINAL WHERE {run} "
                         f"GROUP BY step ORDER BY step")
    moe = rows(target, f"SELECT step, avg(aux_loss) AS aux_loss, avg(z_loss) AS z_loss, "
                       f"avg(expert_utilization) AS utilization, max(load_imbalance) AS imbalance "
                       f"FROM trainmon.moe FINAL WHERE {run} GROUP BY step ORDER BY step")
    memory = rows(target, f"SELECT step, name, sum(device) AS bytes, sum(pinned + pageable) AS host "
                          f"FROM trainmon.allocator FINAL ARRAY JOIN stats.name AS name, "
                          f"stats.device AS device, stats.pinned AS pinned, stats.pageable AS pageable "
                          f"WHERE {run} GROUP BY step, name ORDER BY step, name")
    gpu = rows(target, f"SELECT rank, step, power, temperature, gpu_util, dram_free "
                       f"FROM trainmon.gpu FINAL WHERE {run} ORDER BY rank, step")
    saves = rows(target, f"SELECT step, duration_ms, bytes FROM trainmon.checkpoint_saves "
                         f"WHERE {run} ORDER BY step")
    disk = rows(target, f"SELECT step, min(free_bytes) AS free_bytes FROM trainmon.disk FINAL "
                        f"WHERE {run} GROUP BY step ORDER BY step")
    health = rows(target, f"SELECT rank, id AS gpu, max(ecc_volatile_corrected) AS ecc_corrected, "
                          f"max(ecc_volatile_uncorrected) AS ecc_uncorrected, "
                          f"max(remapped_rows_failed) AS remap_failed, sum(xid_count) AS xid_events "
                          f"FROM trainmon.gpu_health FINAL WHERE {run} GROUP BY rank, gpu ORDER BY rank, gpu")
    warnings = rows(target, f"SELECT source, level, sum(n) AS count, groupArray(rank) AS ranks, "
                            f"any(text) AS example FROM trainmon.log_event_totals WHERE {run} "
                            f"GROUP BY source, level, signature ORDER BY count DESC LIMIT 20")
    alerts = [a for a in alerts_of(target, run_id) if a["state"] == "firing"]
    figures: list[tuple[str, str]] = []

    def mark_alerts(ax) -> None:
        for a in alerts:
            if a["step"] is not None:
                ax.axvline(a["step"], color="red", alpha=0.35, linestyle="--")
                ax.text(a["step"], ax.get_ylim()[1], a["rule"], rotation=90, fontsize=7,
                        color="red", va="top", ha="right")

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for name, ax in zip(("loss", "norm", "lr"), axes):
        _plot_by_rank(ax, steps, name, log_scale=name == "norm")
        if name == "loss" and evals:
            ax.plot([e["step"] for e in evals], [_number(e["loss"]) for e in evals], "k^", label="eval loss")
        ax.set_ylabel({"loss": "loss", "norm": "grad norm", "lr": "learning rate"}[name])
        mark_alerts(ax)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8, ncol=5)
    axes[-1].set_xlabel("step")
    figures.append(("Loss, grad norm and learning rate, with alerts", _png(fig)))
    plt.close(fig)

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, ax, label in ((("tokens_per_second"), axes[0], "tokens/s"),
                            ("duration_ms", axes[1], "step time (ms)")):
        _plot_by_rank(ax, steps, name, log_scale=name == "duration_ms")
        ax.set_ylabel(label)
        mark_alerts(ax)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8, ncol=5)
    axes[-1].set_xlabel("step")
    figures.append(("Throughput and step time per rank", _png(fig)))
    plt.close(fig)

    if moe:
        fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
        for ax, key, label in zip(axes.flat, ("aux_loss", "z_loss", "utilization", "imbalance"),
                                  ("aux loss (x coeff)", "z-loss", "expert utilization",
                                   "load imbalance (max / mean)")):
            ax.plot([m["step"] for m in moe], [_number(m[key]) for m in moe])
            ax.set_title(label, fontsize=9)
        figures.append(("Mixture of experts (mean over ranks; imbalance: worst rank)", _png(fig)))
        plt.close(fig)

    # A CPU run's segments hold host memory and no device bytes: show what it has.
    where = "device" if any(int(m["bytes"]) for m in memory) else "host"
    memory_note = ""
    if memory and where == "host" and not any(int(m["host"]) for m in memory):
        memory_note = "<p>Memory: the allocator records hold no device or host bytes.</p>"
    elif memory:
        fig, ax = plt.subplots(figsize=(10, 3.5))
        for name in sorted({m["name"] for m in memory}):
            points = [m for m in memory if m["name"] == name]
            ax.plot([m["step"] for m in points],
                    [int(m["bytes" if where == "device" else "host"]) / 2**20 for m in points], label=name)
        ax.set_ylabel("MiB (all ranks)")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        title = ("Memory by segment (allocator records)" if where == "device" else
                 "Host memory by segment (pinned + pageable; no device memory: a CPU run)")
        figures.append((title, _png(fig)))
        plt.close(fig)

    if gpu:
        fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
        for ax, key, label, scale in zip(axes.flat, ("power", "temperature", "gpu_util", "dram_free"),
                                         ("power (W)", "temperature (C)", "utilization (%)",
                                          "free memory (GiB)"), (1e-3, 1, 1, 2**-30)):
            for rank, (xs, ys) in sorted(_by_rank(gpu, key).items()):
                ax.plot(xs, [y * scale for y in ys], label=f"rank {rank}")
            ax.set_title(label, fontsize=9)
        figures.append(("GPUs (NVML)", _png(fig)))
        plt.close(fig)

    if saves or disk:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        axes[0].plot([c["step"] for c in saves], [_number(c["duration_ms"]) / 1000 for c in saves], "o-")
        axes[0].set_title("checkpoint save time (s)", fontsize=9)
        axes[1].plot([d["step"] for d in disk], [int(d["free_bytes"]) / 2**30 for d in disk])
        axes[1].set_title("checkpoint disk free (GiB)", fontsize=9)
        for ax in axes:
            ax.set_xlabel("step")
        figures.append(("Checkpoints and their disk", _png(fig)))
        plt.close(fig)

    alert_rows = "".join(
        f"<tr><td>{html.escape(a['rule'])}</td><td>{a['severity']}</td><td>{a['step']}</td>"
        f"<td>{html.escape(str(a['ranks']))}</td><td>{html.escape(a['message'])}</td></tr>"
        for a in alerts)
    body = "".join(f"<h2>{html.escape(title)}</h2><img src='data:image/png;base64,{png}'>"
                   for title, png in figures)
    body += memory_note
    if not gpu:
        body += "<p>No GPU records: this run had no GPU (NVML sampler off).</p>"
    if health:
        body += _table("GPU health (NVML error counters; empty: not reported by the GPU)", health)
    if warnings:
        body += _table("Warnings and errors in the logs", warnings)
    path.write_text(f"""<!doctype html><html><head><meta charset="utf-8">
<title>trainmon report {html.escape(run_id)}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:auto}} td,th{{padding:2px 8px;
border-bottom:1px solid #ddd;font-size:13px;text-align:left}} img{{max-width:100%}}</style></head>
<body><h1>trainmon report: {html.escape(run_id)}</h1>{html_section(target, run_id)}
<h2>Alerts that fired</h2><table><tr><th>rule</th><th>severity</th><th>step</th><th>ranks</th>
<th>message</th></tr>{alert_rows}</table>{body}</body></html>
""")
    return path


def newest_run(target: Target) -> str | None:
    found = rows(target, "SELECT run_id FROM trainmon.run_summary ORDER BY last_seen_at DESC LIMIT 1")
    return found[0]["run_id"] if found else None


def main(argv: list[str] | None = None) -> int:
    from .consumers.clickhouse.service import add_target_arguments, target_from

    parser = argparse.ArgumentParser(prog="trainmon report", description=__doc__.splitlines()[0])
    parser.add_argument("run_id", nargs="?", help="the run (default: the one seen last)")
    parser.add_argument("-o", "--out", type=Path, help="the HTML file (default: trainmon-report-RUN.html)")
    add_target_arguments(parser)
    args = parser.parse_args(argv)
    target = target_from(args)
    run_id = args.run_id or newest_run(target)
    if run_id is None:
        print("trainmon report: no run in ClickHouse yet", file=sys.stderr)
        return 1
    if not rows(target, f"SELECT 1 AS found FROM trainmon.run_summary WHERE run_id = {sql_string(run_id)}"):
        print(f"trainmon report: no run {run_id!r} in ClickHouse", file=sys.stderr)
        return 1
    out = args.out or Path(f"trainmon-report-{safe_name(run_id)}.html")
    print(write_report(target, run_id, out))
    return 0

