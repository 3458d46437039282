"""What the demo prints at the end: rows per table, the alerts, example queries, and
whether each injected anomaly was caught. The HTML report is trainmon.report's."""

from __future__ import annotations

from ..consumers.clickhouse.cli import query
from ..consumers.clickhouse.client import Target
from ..report import alerts_of, rows, write_report

__all__ = ["print_summary", "check_injected", "write_report"]


def print_summary(target: Target, run_id: str, tables: list[str], examples, params: dict) -> None:
    print("   rows per table:")
    for table in tables:
        [count] = rows(target, f"SELECT count() AS n FROM trainmon.{table} FINAL")
        print(f"     trainmon.{table:<10} {count['n']:>6}")
    alerts = alerts_of(target, run_id)
    print(f"   alerts ({sum(a['state'] == 'firing' for a in alerts)} fired, "
          f"{sum(a['state'] == 'resolved' for a in alerts)} resolved):")
    for a in alerts:
        print(f"     {a['state']:<8} {a['severity']:<8} {a['rule']:<24} step {str(a['step']):>4}  "
              f"{a['message']}")
    for title, sql, fmt in examples:
        sql = sql.format(**params)
        print(f"\n   -- {title}\n   {sql}")
        text = query(target, sql, fmt).decode()
        print("\n".join("   " + line for line in text.rstrip().splitlines()))
    print()


def check_injected(target: Target, run_id: str, injected) -> list[str]:
    """Match each injected anomaly with the alert that should have caught it; print the
    verdict and return what was missed. Other alerts are listed as what else fired."""
    fired = [a for a in alerts_of(target, run_id) if a["state"] == "firing"]
    expected = {
        f"grad spike at step {injected.spike_step}":
            lambda a: a["rule"] == "grad_spike" and a["step"] == injected.spike_step,
        f"rank {injected.stall_rank} stalled at step {injected.stall_step}":
            lambda a: a["rule"] == "rank_mismatch" and a["ranks"] == [injected.stall_rank]
            and injected.stall_step - 1 <= a["step"] <= injected.stall_step,
        f"NaN loss on rank {injected.nan_rank} at step {injected.nan_step}":
            lambda a: a["rule"] == "non_finite" and a["ranks"] == [injected.nan_rank]
            and a["step"] == injected.nan_step,
    }
    print("   injected anomaly -> alert:")
    missed, matched = [], set()
    for what, matches in expected.items():
        hits = [a for a in fired if matches(a)]
        matched.update(id(a) for a in hits)
        if hits:
            print(f"     caught  {what}: {hits[0]['rule']} ({hits[0]['severity']}) at step {hits[0]['step']}")
        else:
            print(f"     MISSED  {what}")
            missed.append(what)
    others = [a for a in fired if id(a) not in matched]
    if others:
        print("   also fired (consequences of the injected stall, or this machine's own hiccups):")
        for a in others:
            print(f"     {a['rule']:<24} step {a['step']}: {a['message']}")
    return missed
