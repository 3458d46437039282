"""``trainmon ingest`` as a command: pipe mode passes bytes through like tee, dry-run
prints records, reading a log twice gives the same event ids. No broker needed."""

from __future__ import annotations

import json
import subprocess
import sys

from trainmon.ingest.cli import run_id_for

from .test_ingest_follow import iteration_line


def ingest(*args: str, stdin: bytes | None = None, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "trainmon", "ingest", *args], input=stdin,
                          capture_output=True, timeout=120, env=env)


def records(text: bytes) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith(b'{"log"')]


def test_pipe_passes_every_byte_through_unchanged():
    # Progress bars' carriage returns, invalid UTF-8, colour codes, CRLF, tabs and a last
    # line without its newline: tee would keep them all, so must we.
    job_output = (b"starting\r\n\x1b[32mcolour\x1b[0m \xff\xfe not utf-8\n"
                  + iteration_line(1).encode()
                  + b" 10%|\xe2\x96\x88   | 1/10\r 20%|\xe2\x96\x88\xe2\x96\x88  | 2/10\r"
                  + iteration_line(2).encode() + b"\tno newline at the end")
    done = ingest("-", "--dry-run", "--run-id", "piped", stdin=job_output)
    assert done.returncode == 0, done.stderr
    assert done.stdout == job_output
    steps = [r for r in records(done.stderr) if r["log"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]


def test_dry_run_prints_records_and_ids_are_deterministic(tmp_path):
    log = tmp_path / "job-42.log"
    log.write_text("".join(iteration_line(s) for s in range(1, 6)))
    first, second = ingest("--dry-run", str(log)), ingest("--dry-run", str(log))
    assert first.returncode == 0, first.stderr
    a, b = records(first.stdout), records(second.stdout)
    assert [r["log"] for r in a] == ["run"] + ["step"] * 5
    assert all(r["run_id"] == "job-42" for r in a)          # the run id from the file name
    assert [r["event_id"] for r in a] == [r["event_id"] for r in b]
    assert len({r["event_id"] for r in a}) == 6
    assert a[1]["loss"] == 7.99 and a[1]["timers"] == {"forward-backward": 301.0, "optimizer": 12.5}


def test_unknown_format_is_a_clear_error(tmp_path):
    log = tmp_path / "notes.txt"
    log.write_text("hello\nworld\n")
    done = ingest("--dry-run", str(log))
    assert done.returncode == 2
    assert b"no known log format" in done.stderr and b"--format" in done.stderr


def test_missing_file_is_a_clear_error(tmp_path):
    done = ingest("--dry-run", str(tmp_path / "nope.log"))
    assert done.returncode == 2 and b"no such file" in done.stderr


def test_run_id_from_option_env_or_file_name():
    assert run_id_for("/x/slurm-1234.out", None, {}) == "slurm-1234"
    assert run_id_for("/x/slurm-1234.out", None, {"TRAINMON_RUN_ID": "r7"}) == "r7"
    assert run_id_for("/x/slurm-1234.out", "mine", {"TRAINMON_RUN_ID": "r7"}) == "mine"
    assert run_id_for("-", None, {"SLURM_JOB_ID": "99"}) == "99"
