"""The README's main command, end to end: broker, consumers, a 4-rank torch run with
injected anomalies, then the summary and the report."""

import re
import subprocess
import sys


def test_demo_catches_the_injected_anomalies_and_writes_the_report(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "trainmon", "demo", "--output", str(out)],
                            capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    text = result.stdout
    assert "MISSED" not in text
    caught = re.findall(r"caught  (.*?): (\w+) \(", text)
    assert [rule for _, rule in caught] == ["grad_spike", "rank_mismatch", "non_finite"]
    assert re.search(r"trainmon\.step\s+400\b", text)  # 4 ranks x 100 steps, each exactly once
    report = (out / "report.html").read_text()
    assert report.count("<img src='data:image/png;base64,") >= 4  # loss/norm/lr, speed, MoE, memory
    assert "rank_mismatch" in report and "non_finite" in report
