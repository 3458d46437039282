"""A rank for test_producer_spill_wal.py: logs step records at 50 steps/s until killed.

    python -m tests.spill_kill_child BOOTSTRAP PREFIX SPILL_DIR RUN_ID PROGRESS ARM

Each logged step is appended to PROGRESS as "step wall-time". Once the file ARM exists,
the first message the sender hands to Kafka that holds records logged more than
RESEND_AGE_S ago (a resend of spilled records: a fresh message leaves within the pack
window) makes the sender thread print RESENDING and stop there, so that the test can
kill -9 the process inside that moment rather than at a lucky one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from trainmon.producer import Producer, ProducerConfig

RESEND_AGE_S = 4.0


def main(bootstrap: str, prefix: str, spill_dir: str, run_id: str, progress: str, arm: str) -> None:
    producer = Producer(ProducerConfig(bootstrap=bootstrap, run_id=run_id, topic_prefix=prefix,
                                       spill_dir=spill_dir))
    logged_at: dict[int, float] = {}
    transport = producer._worker._transport
    send = transport.send

    def watched_send(entry, *args, **kwargs):
        first_step = json.loads(entry[2].split(b"\n", 1)[0])["step"]
        if os.path.exists(arm) and time.monotonic() - logged_at[first_step] > RESEND_AGE_S:
            print("RESENDING", flush=True)
            threading.Event().wait()  # held here until the test kills the process
        return send(entry, *args, **kwargs)

    transport.send = watched_send
    with open(progress, "a", buffering=1) as out:
        step = 0
        while True:
            logged_at[step] = time.monotonic()
            producer.log_step(step, loss=2.0, norm=1.0, duration_ms=20.0)
            out.write(f"{step} {time.time()}\n")
            if step == 50:
                print("READY" if producer.flush(30) else "NOT-DELIVERED", flush=True)
            step += 1
            time.sleep(0.02)


if __name__ == "__main__":
    main(*sys.argv[1:])
