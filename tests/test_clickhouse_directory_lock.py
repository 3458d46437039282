"""An embedded chDB directory held by another process: a starting service waits for it.

Both sides run in child processes, because chDB allows one directory per process and the
test process may already have opened another.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

HOLD = textwrap.dedent("""
    import sys, time
    from trainmon.consumers.clickhouse.client import Target, connect
    client = connect(Target(path=sys.argv[1]))
    client.command("SELECT 1")
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    client.close()
""")

OPEN = textwrap.dedent("""
    import logging, sys, time
    logging.basicConfig(level=logging.INFO)
    from trainmon.consumers.clickhouse.client import DirectoryLocked, Target, connect_when_free
    started = time.monotonic()
    try:
        client = connect_when_free(Target(path=sys.argv[1]), wait_s=float(sys.argv[2]), poll_s=0.2)
    except DirectoryLocked as exc:
        print("locked", exc)
        sys.exit(3)
    print("opened", round(time.monotonic() - started, 1), client.command("SELECT 42"))
""")


def _hold(path, seconds: float) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(seconds)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _open(path, wait_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", OPEN, str(path), str(wait_s)],
                          capture_output=True, text=True, timeout=120)


def test_a_briefly_held_directory_is_waited_for(tmp_path):
    holder = _hold(tmp_path / "chdb", 4)
    try:
        opened = _open(tmp_path / "chdb", 60)
    finally:
        holder.wait(30)
    assert opened.returncode == 0, opened.stderr[-2000:]
    word, waited, answer = opened.stdout.split()
    assert (word, answer) == ("opened", "42")
    assert float(waited) >= 1.0, "it opened while the other process still held the directory?"
    assert "in use by another process" in opened.stderr  # said once why it waits


def test_a_directory_held_past_the_wait_names_the_path(tmp_path):
    holder = _hold(tmp_path / "chdb", 30)
    try:
        opened = _open(tmp_path / "chdb", 1)
    finally:
        holder.kill()
        holder.wait()
    assert opened.returncode == 3, opened.stdout + opened.stderr[-2000:]
    assert str(tmp_path / "chdb") in opened.stdout and "in use by another process" in opened.stdout
