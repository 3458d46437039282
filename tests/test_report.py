"""`trainmon report` for any run in ClickHouse, and the report in a real browser: headless
Chromium loads it and every plot is drawn (a decoded image of real size), every section
is there."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dashboard_data import RUN_ID

REPO = Path(__file__).resolve().parents[1]
LOAD = """
import sys
from tests.dashboard_data import records
from trainmon.consumers.clickhouse import Target, connect, create_all, insert_records
client = connect(Target(path=sys.argv[1]))
create_all(client)
insert_records(client, records())
client.close()
"""
# Put into a copy of the report: errors while it loads (a script, an image that does not
# decode), and what the browser made of it once loaded.
WATCH = """<script>window.loadErrors = [];
window.addEventListener('error', e => loadErrors.push(String(e.message || (e.target && e.target.tagName))), true);
</script>"""
CHECK = """<script>window.addEventListener('load', () => {
  const images = [...document.images];
  const drawn = images.filter(i => i.complete && i.naturalWidth > 100 && i.naturalHeight > 100);
  const out = document.createElement('pre'); out.id = 'browser-check';
  out.textContent = JSON.stringify({images: images.length, drawn: drawn.length, errors: loadErrors,
    headings: [...document.querySelectorAll('h2')].map(h => h.textContent)});
  document.body.appendChild(out);
});</script>"""
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=5000", "--dump-dom"]


def trainmon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmon", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=180)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    db = tmp / "chdb"
    subprocess.run([sys.executable, "-c", LOAD, str(db)], cwd=REPO, check=True, timeout=180)
    done = trainmon("report", "--path", str(db), "-o", str(tmp / "report.html"))  # the newest run
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp / "report.html")
    missing = trainmon("report", "no-such-run", "--path", str(db), "-o", str(tmp / "none.html"))
    assert missing.returncode == 1 and "no run 'no-such-run'" in missing.stderr
    return tmp / "report.html"


def test_the_report_holds_the_runs_plots_and_tables(report):
    html = report.read_text()
    assert f"trainmon report: {RUN_ID}" in html
    assert html.count("<img src='data:image/png;base64,") == 6
    assert "grad_norm_spike" in html  # the alerts that fired
    assert "NCCL WARN NET/IB" in html  # the warnings table


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (scripts/bootstrap.sh installs it as root)")
def test_headless_chromium_draws_every_plot(report, tmp_path):
    page = tmp_path / "checked.html"
    page.write_text(report.read_text().replace("<head>", "<head>" + WATCH, 1).replace("</body>", CHECK + "</body>"))
    done = subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                           page.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="browser-check">(.*?)</pre>', done.stdout)
    assert found, done.stderr[-2000:]
    seen = json.loads(found.group(1))
    assert seen["errors"] == [] and seen["images"] == seen["drawn"] == 6
    assert seen["headings"][0].startswith("Goodput of job dash-run: ")  # the report leads with it
    assert seen["headings"][1:4] == ["Alerts that fired", "Loss, grad norm and learning rate, with alerts",
                                    "Throughput and step time per rank"]
    assert {"Checkpoints and their disk", "Warnings and errors in the logs", "GPUs (NVML)"} <= set(seen["headings"])


REPORT_LOAD = """
import math, sys
from datetime import datetime, timedelta, timezone
from trainmon.schemas import CheckpointRecord, EvalRecord, MoeRecord, RunRecord, StepRecord
from trainmon.consumers.clickhouse import Target, connect, create_all, insert_records
t0, ids = datetime(2026, 3, 1, 12, tzinfo=timezone.utc), iter(range(10**6))
def env(s):
    return dict(run_id="odd-run", rank=0, world_size=1, host="h", time=t0 + timedelta(seconds=s),
                event_id=f"e{next(ids)}")
records = [RunRecord(**env(0), event="start", name="odd", project="p")]
for step in range(4):
    records.append(StepRecord(**env(step + 1), step=step, loss=2.0 - step / 10))
    records.append(MoeRecord(**env(step + 1), step=step, aux_loss=math.nan if step == 2 else 0.01))
    records.append(CheckpointRecord(**env(step + 1), step=step, event="saved", bytes=2**30,
                                    duration_ms=[1500.0, math.inf, math.nan, 900.0][step]))
records.append(EvalRecord(**env(9), step=1, loss=2.5))
records.append(EvalRecord(**env(9), step=3, loss=math.inf))
client = connect(Target(path=sys.argv[1]))
create_all(client)
insert_records(client, records)
client.close()
"""


def test_the_report_of_a_run_with_non_finite_checkpoint_times_and_losses(tmp_path):
    """NaN / Inf are data (schemas: a broken timer), and ClickHouse's JSON output (cli.py's
    OUTPUT_SETTINGS, quote_denormals) gives them as the strings "nan" / "inf": the
    checkpoint plot divided such a string by 1000 and the report failed; the eval and MoE
    plots drew the strings as categories."""
    pytest.importorskip("matplotlib")
    db = tmp_path / "chdb"
    subprocess.run([sys.executable, "-c", REPORT_LOAD, str(db)], cwd=REPO, check=True, timeout=180)
    done = subprocess.run([sys.executable, "-c", """
import sys
from pathlib import Path
import matplotlib.axes
from trainmon.consumers.clickhouse.client import Target
from trainmon.report import write_report
plotted = []
real_plot = matplotlib.axes.Axes.plot
def plot(self, *args, **kwargs):
    plotted.append([v for a in args if isinstance(a, (list, tuple)) for v in a])
    return real_plot(self, *args, **kwargs)
matplotlib.axes.Axes.plot = plot
write_report(Target(path=sys.argv[1]), "odd-run", Path(sys.argv[2]))
strings = [v for values in plotted for v in values if isinstance(v, str)]
assert not strings, f"plotted as text: {strings}"
""", str(db), str(tmp_path / "report.html")], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-1500:]
    assert "Checkpoints and their disk" in (tmp_path / "report.html").read_text()
