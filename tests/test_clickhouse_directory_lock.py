"""An embedded chDB directory held by another process: a starting service waits for it.

Both sides run in child processes, because chDB allows one directory per process and the
test process may already have opened another.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

HOLD = textwrap.dedent("""
    import sys
    from trainmon.consumers.clickhouse.client import Target, connect
    client = connect(Target(path=sys.argv[1]))
    client.command("SELECT 1")
    print("held", flush=True)
    sys.stdin.readline()  # held until the test says so (or closes the pipe)
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


def _open(path, wait_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", OPEN, str(path), str(wait_s)],
                          capture_output=True, text=True, timeout=120)


def _hold(path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_briefly_held_directory_is_waited_for(tmp_path):
    holder = _hold(tmp_path / "chdb")
    try:
        opener = subprocess.Popen([sys.executable, "-c", OPEN, str(tmp_path / "chdb"), "60"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        said = ""
        while "in use by another process" not in said and opener.poll() is None:
            said += opener.stderr.readline()  # why it waits: the directory is held ...
        holder.stdin.close()  # ... and only then is it let go
        out, err = opener.communicate(timeout=120)
    finally:
        holder.kill()
        holder.wait(30)
    assert opener.returncode == 0, said + err[-2000:]
    word, _, answer = out.split()
    assert (word, answer) == ("opened", "42")
    assert "in use by another process" in said and "in use by another process" not in err  # said once


def test_a_directory_held_past_the_wait_names_the_path(tmp_path):
    holder = _hold(tmp_path / "chdb")
    try:
        opened = _open(tmp_path / "chdb", 1)
    finally:
        holder.kill()
        holder.wait()
    assert opened.returncode == 3, opened.stdout + opened.stderr[-2000:]
    assert str(tmp_path / "chdb") in opened.stdout and "in use by another process" in opened.stdout
