""""Not logged" is not NaN: a step or eval record carries only what the job logged (step and
loss are required), and every consumer treats an absent value as no data. Also the run
end's reason, shown by run_summary. Pure where possible; ClickHouse in a child process
(chDB hosts one data directory per process), TensorBoard on local event files."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from trainmon.consumers.alerts import AlertEngine, load_config
from trainmon.consumers.clickhouse.ddl import field_columns
from trainmon.consumers.forwarding import RunProgress, RunWork
from trainmon.consumers.metric_names import scalars
from trainmon.producer.surogate import ConsoleLine, JsonLogFile
from trainmon.schemas import EvalRecord, RunRecord, StepRecord, decode, encode

from .alerts_support import process_records, synthetic_run

REPO = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 4, 1, 8, 0, 0, tzinfo=timezone.utc)
ABSENT = ("epoch", "step_tokens", "duration_ms", "norm", "lr")


def env(rank: int = 0, seconds: float = 0.0, event_id: str = "e-1", run_id: str = "opt") -> dict:
    return dict(run_id=run_id, rank=rank, world_size=2, host=f"node-{rank}",
                time=T0 + timedelta(seconds=seconds), event_id=event_id)


# -- the schema ---------------------------------------------------------------------------

def test_a_step_with_only_step_and_loss_round_trips():
    record = StepRecord(**env(), step=7, loss=2.5)
    assert all(getattr(record, name) is None for name in ABSENT)
    assert record.tokens_per_second is None
    wire = encode(record)
    assert not any(f'"{name}"'.encode() in wire for name in ABSENT)  # absent, not null or 0
    back = decode("step", wire)
    assert back == record and back.norm is None and back.duration_ms is None
    # A log may print no loss (Megatron, for an interval whose iterations were all
    # skipped); the producer's log_step still asks for one (tests/test_producer_never_raises).
    assert StepRecord(**env(), step=1).loss is None


def test_an_eval_with_only_step_and_loss_round_trips():
    record = EvalRecord(**env(), step=3, loss=math.log(4))
    assert record.epoch is None and record.eval_tokens is None and record.duration_ms is None
    assert record.tokens_per_second is None and record.perplexity == pytest.approx(4.0)
    assert decode("eval", encode(record)) == record
    with pytest.raises(ValueError, match="loss"):
        EvalRecord(**env(), step=1)


def test_tokens_per_second_needs_both_tokens_and_duration():
    both = StepRecord(**env(), step=1, loss=1.0, step_tokens=1000, duration_ms=500.0)
    assert both.tokens_per_second == 2000.0
    assert StepRecord(**env(), step=1, loss=1.0, step_tokens=1000).tokens_per_second is None
    assert StepRecord(**env(), step=1, loss=1.0, duration_ms=500.0).tokens_per_second is None
    assert EvalRecord(**env(), step=1, loss=1.0, eval_tokens=10).tokens_per_second is None
    assert EvalRecord(**env(), step=1, loss=1.0, eval_tokens=10, duration_ms=100.0).tokens_per_second == 100.0


def test_the_optional_fields_are_nullable_columns_and_reason_is_a_column():
    for name, ch in (("norm", "Float64"), ("lr", "Float64"), ("epoch", "Float64"),
                     ("step_tokens", "Int64"), ("duration_ms", "Float64")):
        assert field_columns(StepRecord, name).definition == f"`{name}` Nullable({ch})"
    for name, ch in (("epoch", "Float64"), ("eval_tokens", "Int64"), ("duration_ms", "Float64")):
        assert field_columns(EvalRecord, name).definition == f"`{name}` Nullable({ch})"
    assert field_columns(StepRecord, "loss").definition == "`loss` Nullable(Float64)"
    assert field_columns(StepRecord, "step").definition == "`step` Int64"
    assert field_columns(RunRecord, "reason").definition == "`reason` Nullable(String)"


def test_run_end_carries_a_reason():
    end = RunRecord(**env(), event="end", status="failed", reason="CUDA out of memory")
    assert decode("run", encode(end)).reason == "CUDA out of memory"
    assert RunRecord(**env(), event="end").reason is None


# -- producer-side local output ------------------------------------------------------------

def test_console_line_prints_absent_values_as_n_a():
    line = ConsoleLine(stream=io.StringIO())
    full = line.format(StepRecord(**env(), step=1, loss=2.0, norm=0.5, step_tokens=1000,
                                  duration_ms=100.0, total_steps=10))
    assert "norm 0.5000" in full and "100 ms" in full
    bare = line.format(StepRecord(**env(), step=2, loss=1.9, total_steps=10))
    assert "norm n/a" in bare and "n/a tps" in bare and "n/a ms" in bare
    assert bare.startswith(":: step 2 [ 20.0%]")
    # a NaN step time is shown as such and does not break the ETA
    nan = line.format(StepRecord(**env(), step=3, loss=1.8, duration_ms=math.nan, total_steps=10))
    assert "nan ms" in nan and "eta" in nan


def test_json_log_file_leaves_absent_values_out(tmp_path):
    log = JsonLogFile(str(tmp_path / "log.jsonl"))
    log(StepRecord(**env(), step=1, loss=2.0))
    log.close()
    line = json.loads((tmp_path / "log.jsonl").read_text())
    assert line["log"] == "step" and line["loss"] == 2.0
    assert not set(ABSENT) & set(line)


# -- forwarders ------------------------------------------------------------------------------

def test_absent_values_give_no_scalar_and_nan_stays_nan():
    names = {s.metric: s.value for s in scalars(StepRecord(**env(), step=1, loss=2.0, lr=1e-4))}
    assert names == {"train/loss": 2.0, "train/lr": 1e-4}
    nan = {s.metric: s.value for s in scalars(StepRecord(**env(), step=1, loss=2.0, norm=math.nan))}
    assert set(nan) == {"train/loss", "train/norm"} and math.isnan(nan["train/norm"])
    evals = {s.metric for s in scalars(EvalRecord(**env(), step=1, loss=2.0))}
    assert evals == {"eval/loss", "eval/perplexity"}


def test_tensorboard_writes_no_point_for_an_absent_norm(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    from trainmon.consumers.tensorboard_sink import TensorBoardSink

    sink = TensorBoardSink(tmp_path / "tb")
    records = [StepRecord(**env(0, s, f"s{s}"), step=s, loss=3.0 - s, lr=1e-3,
                          **({"norm": 0.5 + s} if s != 1 else {}))
               for s in range(3)]
    sink.write(RunWork("opt", RunProgress("opt"), records=records))
    sink.flush()
    sink.close()
    acc = event_accumulator.EventAccumulator(str(sink.run_dir("opt", 0)),
                                             size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    series = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert series["train/norm"] == [(0, 0.5), (2, 2.5)]  # step 1 logged no norm: no point
    assert [step for step, _ in series["train/loss"]] == [0, 1, 2]
    assert not {"train/epoch", "train/duration_ms", "train/tokens_per_second"} & set(series)


# -- alerts ----------------------------------------------------------------------------------

def drop(*names, at=None):
    def mutate(s, r, step, gpu, moe):
        if at is None or s in at:
            for name in names:
                step.pop(name, None)
    return mutate


def test_alert_engine_treats_absent_values_as_no_data():
    engine = AlertEngine(load_config(env={}))
    records = synthetic_run("bare", t0=time.time() - 900, ranks=3, steps=60,
                            mutate=drop("norm", "duration_ms", "lr", "step_tokens", "epoch"))
    alerts = process_records(engine, records)
    alerts += engine.tick(time.time())
    assert alerts == []
    assert engine.runs == {}  # ended and forgotten, no crash on the way


def test_a_step_without_norm_neither_fires_nor_resolves_a_norm_incident():
    def mutate(s, r, step, gpu, moe):
        if s == 30:
            step["norm"] = 50.0  # a spike: > 5x the moving average of ~1
        if s in (31, 32, 33):
            step.pop("norm")
            step.pop("duration_ms")
        if s == 40:
            step["loss"] = math.nan
            step.pop("norm")
    engine = AlertEngine(load_config(env={}))
    alerts = process_records(engine, synthetic_run("gap", t0=time.time() - 900, steps=45, mutate=mutate,
                                              end=False))
    spike = [(a.state, a.step) for a in alerts if a.rule == "grad_spike"]
    # fires at 30; the steps without a norm say nothing; step 34's healthy norm resolves it
    assert spike == [("firing", 30), ("resolved", 34)]
    non_finite = [(a.state, a.step, a.message) for a in alerts if a.rule == "non_finite"]
    assert [(s, step) for s, step, _ in non_finite] == [("firing", 40), ("resolved", 41)]
    assert "loss is nan" in non_finite[0][2] and "grad norm" not in non_finite[0][2]
    # the engine's state survives a checkpoint (no None / NaN in its windows)
    state = json.loads(json.dumps(engine.dump()))
    AlertEngine(load_config(env={})).load(state)


def test_nan_step_times_do_not_poison_the_step_time_rules():
    def mutate(s, r, step, gpu, moe):
        if s % 2:
            step["duration_ms"] = math.nan
    engine = AlertEngine(load_config(env={}))
    alerts = process_records(engine, synthetic_run("nan-ms", t0=time.time() - 900, ranks=3, steps=60,
                                              mutate=mutate, end=False))
    assert [a for a in alerts if a.rule in ("iteration_time_spike", "straggler")] == []
    step_seconds = engine.runs["nan-ms"].step_seconds.values
    assert len(step_seconds) > 0 and all(math.isfinite(v) for v in step_seconds)


# -- ClickHouse (chDB in a child process) ---------------------------------------------------

CHILD = r"""
import json, sys
from trainmon.consumers.clickhouse import Target, connect, create_all, insert_records
from trainmon.schemas import decode

path, mode, out_html = sys.argv[1], sys.argv[2], sys.argv[3]
records = [decode(kind, line.encode()) for kind, line in json.load(sys.stdin)]
client = connect(Target(path=path))
if mode == "old-tables":
    # Tables as an older trainmon made them: required step / eval fields, no run reason.
    from trainmon.consumers.clickhouse.ddl import create_table_sql
    old = {"step": [("`norm` Nullable(Float64)", "`norm` Float64"),
                    ("`lr` Nullable(Float64)", "`lr` Float64"),
                    ("`duration_ms` Nullable(Float64)", "`duration_ms` Float64")],
           "eval": [("`eval_tokens` Nullable(Int64)", "`eval_tokens` Int64")],
           "run": [(",\n    `reason` Nullable(String)", "")]}
    client.command("CREATE DATABASE trainmon")
    for kind, changes in old.items():
        sql = create_table_sql(kind, "trainmon")
        for new, before in changes:
            assert new in sql, (new, sql)
            sql = sql.replace(new, before)
        client.command(sql)
create_all(client)  # (the next start, for old tables)
insert_records(client, records)
out = {}
for name, sql in json.load(open(sys.argv[4])).items():
    result = client.query(sql)
    out[name] = [dict(zip(result.column_names, row)) for row in result.result_rows]
client.close()
if out_html != "-":
    from pathlib import Path
    from trainmon.report import write_report
    write_report(Target(path=path), "opt", Path(out_html))
print(json.dumps(out, default=str))
"""

QUERIES = {
    "steps": "SELECT rank, step, loss, norm, lr, epoch, step_tokens, duration_ms, tokens_per_second "
             "FROM trainmon.step FINAL WHERE run_id = 'opt' ORDER BY step, rank",
    "types": "SELECT table, name, type FROM system.columns WHERE database = 'trainmon' AND "
             "((table = 'step' AND name IN ('norm', 'lr', 'duration_ms', 'loss')) OR "
             "(table = 'eval' AND name = 'eval_tokens') OR (table = 'run' AND name = 'reason')) "
             "ORDER BY table, name",
    "across": "SELECT step, ranks_reporting, min_duration_ms, mean_duration_ms, step_tokens, mean_loss "
              "FROM trainmon.step_across_ranks WHERE run_id = 'opt' ORDER BY step",
    "latest": "SELECT rank, step, norm, duration_ms, lr FROM trainmon.latest_step WHERE run_id = 'opt' "
              "ORDER BY rank",
    "summary": "SELECT run_id, status, reason, steps, tokens FROM trainmon.run_summary ORDER BY run_id",
    "averages": "SELECT avg(norm) AS mean_norm, count(norm) AS norms, sum(step_tokens) AS tokens "
                "FROM trainmon.step FINAL",
}


def clickhouse_records() -> list:
    records = [RunRecord(**env(0, -5, "start"), event="start", name="opt")]
    for step in range(3):
        # rank 0 logs everything, rank 1 only step and loss (and a NaN step time at step 2)
        records.append(StepRecord(**env(0, step * 10, f"s0-{step}"), step=step, epoch=0.1 * step,
                                  step_tokens=1000, duration_ms=100.0 + step, loss=3.0 - step,
                                  norm=1.0, lr=0.1))
        records.append(StepRecord(**env(1, step * 10 + 1, f"s1-{step}"), step=step, loss=3.5 - step,
                                  **({"duration_ms": math.nan} if step == 2 else {})))
    records.append(EvalRecord(**env(0, 25, "eval"), step=2, loss=1.5))
    records.append(RunRecord(**env(1, 40, "end-1"), event="end", status="failed",
                             reason="torch.OutOfMemoryError: CUDA out of memory"))
    records.append(RunRecord(**env(0, 41, "end-0"), event="end", status="failed"))
    # a run that ended and started again: its old reason no longer applies
    records.append(RunRecord(**env(0, 0, "r2-start", run_id="opt-resumed"), event="start"))
    records.append(RunRecord(**env(0, 1, "r2-end", run_id="opt-resumed"), event="end",
                             status="failed", reason="NCCL watchdog timeout"))
    records.append(RunRecord(**env(0, 2, "r2-again", run_id="opt-resumed"), event="start"))
    # a run without any step_tokens
    records.append(StepRecord(**env(0, 0, "r3-s", run_id="opt-no-tokens"), step=0, loss=1.0))
    return records


def run_child(tmp_path: Path, mode: str, html: bool = False) -> dict:
    queries = tmp_path / "queries.json"
    queries.write_text(json.dumps(QUERIES))
    out_html = str(tmp_path / "report.html") if html else "-"
    wire = [[r.kind, encode(r).decode()] for r in clickhouse_records()]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "chdb"), mode, out_html,
                           str(queries)], input=json.dumps(wire), capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def check_clickhouse(out: dict) -> None:
    steps = out["steps"]
    bare = [r for r in steps if r["rank"] == 1]
    assert [(r["norm"], r["lr"], r["epoch"], r["step_tokens"], r["tokens_per_second"]) for r in bare] \
        == [(None, None, None, None, None)] * 3
    assert [r["duration_ms"] for r in bare][:2] == [None, None]
    assert math.isnan(bare[2]["duration_ms"])  # a logged NaN is kept as NaN, not NULL
    full = [r for r in steps if r["rank"] == 0 and r["step"] == 0]
    assert full[0]["norm"] == 1.0 and full[0]["tokens_per_second"] == 10_000.0

    # The views aggregate over what was logged.
    across = out["across"]
    assert [(r["step"], r["ranks_reporting"], r["min_duration_ms"], r["mean_duration_ms"],
             r["step_tokens"]) for r in across] == [(0, 2, 100.0, 100.0, 1000), (1, 2, 101.0, 101.0, 1000),
                                                    (2, 2, 102.0, 102.0, 1000)]
    latest = {r["rank"]: r for r in out["latest"]}
    assert latest[1]["norm"] is None and latest[1]["lr"] is None and latest[0]["norm"] == 1.0
    assert out["averages"] == [{"mean_norm": 1.0, "norms": 3, "tokens": 3000}]

    summary = {r["run_id"]: r for r in out["summary"]}
    assert summary["opt"]["status"] == "failed"
    assert summary["opt"]["reason"] == "torch.OutOfMemoryError: CUDA out of memory"
    assert summary["opt"]["tokens"] == 3000
    assert summary["opt-resumed"]["status"] == "running" and summary["opt-resumed"]["reason"] is None
    assert summary["opt-no-tokens"]["steps"] == 1 and summary["opt-no-tokens"]["tokens"] is None


def test_clickhouse_stores_absent_values_as_null_and_run_summary_shows_the_reason(tmp_path):
    out = run_child(tmp_path, "fresh", html=True)
    types = {(r["table"], r["name"]): r["type"] for r in out["types"]}
    assert types[("step", "norm")] == "Nullable(Float64)" and types[("step", "loss")] == "Nullable(Float64)"
    check_clickhouse(out)
    # The demo report copes with the NULLs (and says which metric was not logged at all).
    assert (tmp_path / "report.html").read_text().count("<img") >= 2


def test_existing_tables_are_migrated_to_nullable_and_gain_the_reason(tmp_path):
    out = run_child(tmp_path, "old-tables")
    types = {(r["table"], r["name"]): r["type"] for r in out["types"]}
    assert types == {("eval", "eval_tokens"): "Nullable(Int64)", ("run", "reason"): "Nullable(String)",
                     ("step", "duration_ms"): "Nullable(Float64)", ("step", "loss"): "Nullable(Float64)",
                     ("step", "lr"): "Nullable(Float64)", ("step", "norm"): "Nullable(Float64)"}
    check_clickhouse(out)
