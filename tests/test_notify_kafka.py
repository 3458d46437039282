"""Alert delivery on the real broker, as a process: ``trainmon consume notify`` killed with
-9 in the middle of a burst of 200 incidents (fired, then resolved) and started again
delivers each state change exactly once; a replay with a new group delivers none again."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading

import pytest

from trainmon import topics
from trainmon.consumers.alerts.alert_topic import AlertPublisher

from .clickhouse_service import trainmon_env
from .notify_support import WebhookServer, alert, resolved
from .waiting import wait_until

pytestmark = pytest.mark.timeout(240)
RUNS, RANKS = 50, 4  # 200 incidents: a NaN on every rank of 50 runs
KILL_AT_REQUESTS = (15, 45)  # requests the receiver takes the sink down at, unanswered


class NotifyProcess:
    def __init__(self, bootstrap: str, prefix: str, state_dir, url: str, log):
        self.args = [sys.executable, "-m", "trainmon", "consume", "notify", "--notify", url,
                     "--topic-prefix", prefix, "-v"]
        self.env = trainmon_env(bootstrap, TRAINMON_NOTIFY_STATE_DIR=state_dir, TRAINMON_NOTIFY_GROUP_WAIT_S="0.05",
                                TRAINMON_NOTIFY_RATE_PER_MIN="10000")
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> subprocess.Popen:
        self.proc = subprocess.Popen([*self.args, *extra], env=self.env, stdout=open(self.log, "a"),
                                     stderr=subprocess.STDOUT)
        return self.proc

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def test_kill_9_during_a_burst_delivers_each_state_change_exactly_once(kafka_broker, bootstrap, topic_prefix,
                                                                      tmp_path):
    kafka_broker.create_topics([topics.topic_for("alert", topic_prefix)])
    fired = [alert(f"burst-{run:02d}", "nan", f"rank{r}", ranks=[r], step=100 + run)
             for run in range(RUNS) for r in range(RANKS)]
    changes = fired + [resolved(a) for a in fired]
    publisher = AlertPublisher(topics.topic_for("alert", topic_prefix), env={"TRAINMON_KAFKA_BOOTSTRAP": bootstrap})
    publisher.publish(changes)
    publisher.close()

    with WebhookServer() as hook:
        sink = NotifyProcess(bootstrap, topic_prefix, tmp_path / "state", hook.json_url(), tmp_path / "notify.log")
        requests = 0
        killed = []
        lock = threading.Lock()

        def kill_at_some(entry) -> bool:
            nonlocal requests
            with lock:
                requests += 1
                if requests in KILL_AT_REQUESTS:
                    os.kill(sink.proc.pid, signal.SIGKILL)
                    killed.append(requests)
                    return False
            return True

        hook.received.before_answer = kill_at_some
        sink.start()
        expected = {a.event_id for a in changes}
        for kills in range(1, len(KILL_AT_REQUESTS) + 1):
            wait_until(lambda: len(killed) >= kills, 120, f"kill -9 number {kills}",
                       details=lambda: (tmp_path / "notify.log").read_text()[-2000:])
            assert sink.proc.wait(30) == -signal.SIGKILL
            sink.start()
        wait_until(lambda: set(hook.received.event_ids()) >= expected, 120, "every state change delivered",
                   details=lambda: f"{len(set(hook.received.event_ids()))} of {len(expected)}; "
                                   + (tmp_path / "notify.log").read_text()[-2000:])
        assert sink.stop() == 0
        counts = collections.Counter(hook.received.event_ids())
        assert set(counts) == expected
        assert [e for e, n in counts.items() if n != 1] == []
        # Grouped: a run's 4 ranks in one message per change (less where a kill split a batch).
        assert len(hook.received.bodies()) < len(expected) / 2

        # A replay from the beginning under a new group: the delivered state says it all went.
        before = len(hook.received.bodies())
        replay = sink.start("--group", f"{topic_prefix}replay", "--exit-when-idle", "1")
        assert replay.wait(60) == 0
        assert len(hook.received.bodies()) == before
        assert f"stopped after {len(changes)} record(s)" in (tmp_path / "notify.log").read_text()
