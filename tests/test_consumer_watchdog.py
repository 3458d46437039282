"""The watchdog that turns a stuck kafka-python call into a restart (exit 75)."""

import subprocess
import sys
import textwrap

from trainmon.consumers.watchdog import EXIT_STUCK


def run(body: str, limit: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(f"""
        import logging, os, time
        from trainmon.consumers.watchdog import KafkaCallWatchdog
        logging.basicConfig()
        os.environ["TRAINMON_KAFKA_STUCK_SECONDS"] = "{limit}"
        watchdog = KafkaCallWatchdog.from_env(name="test-group")
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


def test_a_call_stuck_past_the_limit_exits_75_naming_the_call_with_stacks():
    result = run("""
        def hang_like_kafka_python():
            with watchdog.watch("poll"):
                time.sleep(30)
        hang_like_kafka_python()
    """, limit="1")
    assert result.returncode == EXIT_STUCK, result.stderr
    assert "trainmon test-group: Kafka poll() has not returned for" in result.stderr
    assert "hang_like_kafka_python" in result.stderr  # every thread's stack is dumped


def test_calls_that_return_in_time_and_a_disabled_watchdog_do_nothing():
    within = run("""
        for _ in range(6):
            with watchdog.watch("commit"):
                time.sleep(0.4)
            time.sleep(0.4)  # between calls nothing is watched
        print("done")
    """, limit="1")
    assert within.returncode == 0 and within.stdout.strip() == "done", within.stderr
    off = run("""
        with watchdog.watch("poll"):
            time.sleep(3)
        print("done")
    """, limit="0")
    assert off.returncode == 0 and off.stdout.strip() == "done", off.stderr


def test_a_closed_watchdog_stops_its_thread():
    """A process that opens and closes many streams must not keep a thread per stream."""
    result = run("""
        import threading
        with watchdog.watch("poll"):
            pass
        assert any(t.name == "trainmon-kafka-watchdog" for t in threading.enumerate())
        watchdog.close()
        time.sleep(1.0)
        print(sum(t.name == "trainmon-kafka-watchdog" for t in threading.enumerate()))
    """, limit="2")
    assert result.returncode == 0 and result.stdout.strip() == "0", result.stdout + result.stderr
