"""scripts/gpu_check.py, run on GPU machines (CI has none), keeps working: here on the CPU,
where it trains, checks what needs no GPU, says the GPU checks are skipped and writes the
records it sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_on_a_machine_without_a_gpu(tmp_path):
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path), "--seconds", "1",
                           "--no-frameworks"], capture_output=True, text=True, cwd=REPO, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ok     every step record sent" in done.stdout
    assert "no CUDA: the GPU checks are skipped" in done.stdout
    kinds = {json.loads(line)["kind"] for line in (tmp_path / "gpu-records.jsonl").read_text().splitlines()}
    assert kinds >= {"run", "step", "allocator"}
