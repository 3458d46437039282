"""The console-log reader's line splitting in memory and on files: progress-bar draws read
as they come, a rotated file read to its end. No broker."""

from __future__ import annotations

import os
import threading
from datetime import datetime, timezone

from trainmon.ingest import reader
from trainmon.ingest.session import Session


# https://github.com/NVIDIA/NeMo-Framework-Launcher/issues/55 (as in test_ingest_formats.py)
NEMO1_DRAW = ("Epoch 0:   1%|          | {n}/77225 [9:07:58<878:01:48, 41.36s/it, loss=3.1, v_num=, "
              "reduced_train_loss={loss}, global_step={step}, consumed_samples=1.63e+6]")


def _until_idle(lines) -> list[str]:
    out = []
    for line in lines:
        if line is None:
            return out
        out.append(line)
    return out


def test_follow_reads_progress_bar_draws_before_the_bar_ever_prints_a_newline(tmp_path):
    # Lightning's bar (NeMo 1) redraws with "\r" and writes its newline only when the
    # epoch ends: a job's steps of a whole epoch are one unterminated "line". Each draw
    # before the last "\r" is complete; a follower must read them as they come, not
    # hours later at the epoch's end.
    path = tmp_path / "nemo1.log"
    path.write_text("\r" + "\r".join([NEMO1_DRAW.format(n=795, loss="3.090", step="794.0"),
                                      NEMO1_DRAW.format(n=796, loss="3.050", step="795.0"),
                                      NEMO1_DRAW.format(n=797, loss="3.010", step="796.0")]))
    records = []
    session = Session("bar", records.append, fmt="nemo", host="h",
                      clock=lambda: datetime(2030, 1, 1, tzinfo=timezone.utc))
    stop = threading.Event()
    for line in _until_idle(reader.follow(path, stop=stop)):
        session.feed(line)
    session.idle()  # the log went quiet: what the parser holds is sent
    steps = [(r.step, r.loss) for r in records if r.kind == "step"]
    # 796's draw (after the last "\r") may still be being written: not read yet.
    assert steps == [(794, 3.09), (795, 3.05)]


def test_pipe_reads_progress_bar_draws_before_a_newline():
    r, w = os.pipe()
    try:
        os.write(w, ("\r" + NEMO1_DRAW.format(n=795, loss="3.090", step="794.0")
                     + "\r" + NEMO1_DRAW.format(n=796, loss="3.050", step="795.0")).encode())
        with os.fdopen(r, "rb", buffering=0) as source:
            got = _until_idle(reader.pipe(source, None, idle_s=0.05))
    finally:
        os.close(w)
    assert any("global_step=794.0" in line for line in got), got


def test_follow_split_draws_read_the_same_as_a_backfill(tmp_path):
    # The early draws change nothing a backfill of the same bytes reads (same records,
    # same event ids), and "\r\n" cut between two reads is still one line end.
    text = ("\r" + "\r".join(NEMO1_DRAW.format(n=n, loss=f"3.{n % 100:02d}", step=f"{n - 1}.0")
                             for n in range(795, 800)) + "\r\nafter\r\n")
    path = tmp_path / "a.log"
    path.write_bytes(b"")

    def session(into):
        return Session("same", into.append, fmt="nemo", host="h",
                       clock=lambda: datetime(2030, 1, 1, tzinfo=timezone.utc))

    followed: list = []
    s = session(followed)
    stop = threading.Event()
    lines = reader.follow(path, stop=stop, idle_s=0.01)
    data = text.encode()
    for cut in (len(data) // 3, len(data) - 1, len(data)):  # the last cut splits "\r\n"
        with open(path, "ab") as f:
            f.write(data[:cut])
        data = data[cut:]
        for line in _until_idle(lines):
            s.feed(line)
        s.idle()
        if not data:
            break
    s.finish()
    lines.close()

    backfilled: list = []
    b = session(backfilled)
    for line in text.split("\n")[:-1]:
        b.feed(line)
    b.finish()
    assert [(r.kind, r.event_id, getattr(r, "step", None)) for r in followed] == \
        [(r.kind, r.event_id, getattr(r, "step", None)) for r in backfilled]


def test_follow_reads_a_rotated_file_to_its_end_before_switching(tmp_path, monkeypatch):
    # reader.follow promises "a file renamed away (rotated) is read to its end before the
    # new file at path is opened". The job still holds the old file open after the rename;
    # a line it appends there after the follower's last (empty) read, but before the
    # follower notices the new file, must not be lost.
    path, old = tmp_path / "train.log", tmp_path / "train.log.1"
    path.write_text("before\n")
    stop = threading.Event()
    lines = reader.follow(path, stop=stop)
    assert next(lines) == "before"

    os.rename(path, old)            # logrotate: rename, then a new file at the path
    path.write_text("new file\n")
    real_stat = os.stat
    late = {"written": False}

    def stat(p, *args, **kwargs):
        # The job's write to its still-open old file lands between the follower's empty
        # read and its look at the path (no sleep: the interleaving is forced here).
        if not late["written"] and os.fspath(p) == os.fspath(path):
            late["written"] = True
            with open(old, "a") as f:
                f.write("late line in the old file\n")
        return real_stat(p, *args, **kwargs)

    monkeypatch.setattr(reader.os, "stat", stat)
    got = _until_idle(lines)
    lines.close()
    assert late["written"]
    assert got == ["late line in the old file", "new file"]
