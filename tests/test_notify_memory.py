"""Alert delivery's contract in memory (MemoryBroker, a local webhook server, no Kafka):
one message per incident change, a burst as one message, minimum severities, the rate
limit, retries with failures counted, actions once, and a replay that delivers nothing
again. test_notify_kafka.py kills the sink for real; test_notify_alertmanager.py posts to
a real Alertmanager."""

from __future__ import annotations

import json
import sys
import time

import pytest

from trainmon.consumers.notify import messages
from trainmon.consumers.notify.delivered import DeliveredLog

from .notify_support import MailServer, WebhookServer, alert, broker_with, deliver, nan_burst, notify_env, resolved

pytestmark = pytest.mark.timeout(60)


def test_nan_on_64_ranks_is_one_message_naming_the_count_and_the_first_ranks(tmp_path):
    burst = nan_burst("run-64", 64, step=1234)
    with WebhookServer() as hook:
        sink = deliver(broker_with(burst), notify_env(tmp_path, hook.json_url()))
    [body] = hook.received.bodies()
    assert "nan" in body["title"] and "run-64" in body["title"] and "step 1234" in body["title"]
    assert "64 ranks: 0, 1, 2, 3, 4, 5, 6, 7 and 56 more" in body["message"]
    assert "run run-64, rule nan" in body["message"]
    assert sorted(hook.received.event_ids()) == sorted(a.event_id for a in burst)
    assert sink.stats["messages"] == 1 and sink.stats["alerts"] == 64 and sink.stats["failures"] == 0


def test_each_incident_change_is_one_message_and_a_replay_sends_none_again(tmp_path):
    fired = alert("run-b", "loss_spike", "run", severity="warning", ranks=[0, 1], step=300, value=9.5,
                  threshold=4.0)
    escalated = alert("run-b", "loss_spike", "run", severity="critical", ranks=[0, 1], step=310, ordinal=2,
                      value=95.0, message="loss 95 [escalated from 9.5 at step 300, incident #1]")
    superseded = alert("run-b", "loss_spike", "run", state="resolved", severity="warning", ranks=[0, 1],
                       step=310, message="resolved (escalated, superseded by #2) at step 310: ...")
    broker = broker_with([fired])
    with WebhookServer() as hook:
        env = notify_env(tmp_path, hook.json_url())
        deliver(broker, env)
        broker_with([superseded, escalated], broker)
        deliver(broker, env)
        broker_with([resolved(escalated)], broker)
        deliver(broker, env)
        titles = [b["title"] for b in hook.received.bodies()]
        assert [t.split(" on run")[0] for t in titles] == [
            "[WARNING] loss_spike firing", "[CRITICAL] loss_spike escalated", "[CRITICAL] loss_spike resolved"]
        assert "value 9.5, threshold 4.0" in hook.received.bodies()[0]["message"]
        # The group reset, every alert read again: nothing is sent twice.
        replay = deliver(broker, env, group="trainmon-notify-replay")
        assert len(hook.received.bodies()) == 3 and replay.stats["messages"] == 3


def test_each_url_gets_what_is_at_least_its_minimum_severity(tmp_path):
    warning = alert("run-c", "grad_norm", "run", severity="warning")
    critical = alert("run-c", "nan", "rank0", severity="critical")
    with WebhookServer() as hook:
        deliver(broker_with([warning, critical]),
                notify_env(tmp_path, f"{hook.json_url('/all')} critical={hook.json_url('/paging')}"))
    assert [b["title"].split(" on")[0] for b in hook.received.bodies("/paging")] == ["[CRITICAL] nan firing"]
    assert len(hook.received.bodies("/all")) == 2


def test_the_rate_limit_per_run_holds_back_and_counts_and_the_next_message_says_so(tmp_path):
    flood = [alert("run-d", f"rule{i}", "run", severity="warning") for i in range(5)]
    other_run = alert("run-e", "nan", "rank0")
    with WebhookServer() as hook:
        sink = deliver(broker_with([*flood, other_run]),
                       notify_env(tmp_path, hook.json_url(), notify_rate_per_min="2"))
    runs = [b["title"].split("on run ")[1].split()[0] for b in hook.received.bodies()]
    assert runs.count("run-d") == 2 and runs.count("run-e") == 1
    assert sink.stats["rate_limited"] == 3


def test_a_refused_delivery_is_retried_with_backoff_and_counted_and_sent_once(tmp_path):
    fired = alert("run-f", "nan", "rank3", ranks=[3])
    with WebhookServer() as hook:
        hook.received.refuse = 2
        sink = deliver(broker_with([fired]), notify_env(tmp_path, hook.json_url()))
    assert hook.received.refused == 2
    assert hook.received.event_ids() == [fired.event_id]
    assert sink.stats["failures"] == 2
    saved = json.loads(sink.stats_path.read_text())
    assert saved["failures"] == 2 and saved["messages"] == 1


def test_a_url_failing_for_good_is_given_up_so_the_others_still_get_their_messages(tmp_path):
    first, second = alert("run-j", "nan", "rank0"), alert("run-j", "stall", "rank1", ranks=[1])
    with WebhookServer() as hook:
        hook.received.refuse = 10**6  # the dead URL's server and the live one's: told apart by path
        dead = f"json://127.0.0.1:{hook.port}/dead"
        with WebhookServer() as live:
            broker = broker_with([first])
            env = notify_env(tmp_path, f"{dead} {live.json_url()}", notify_give_up_after_s="0.2")
            sink = deliver(broker, env)
            broker_with([second], broker)
            deliver(broker, env)
    assert live.received.event_ids() == [first.event_id, second.event_id]
    assert sink.stats["given_up"] == 1 and sink.stats["failures"] >= 2


def test_a_slack_url_gets_the_message_in_slacks_format(tmp_path, monkeypatch):
    from apprise.plugins.slack import NotifySlack

    fired = alert("run-g", "stall", "rank1", ranks=[1], step=77, value=None)
    with WebhookServer() as hook:
        # Slack's webhook host, pointed at the local server: the payload is what Slack gets.
        monkeypatch.setattr(NotifySlack, "webhook_url", f"http://127.0.0.1:{hook.port}/services")
        deliver(broker_with([fired]), notify_env(tmp_path, "slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7"))
    [request] = hook.received.requests
    assert request["path"] == "/services/T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7"
    text = json.dumps(request["body"])
    assert "run-g" in text and "stall" in text and "step 77" in text and "1 rank: 1" in text


def test_an_email_names_the_run_rule_step_and_ranks(tmp_path):
    burst = nan_burst("run-mail", 16, step=4321)
    with MailServer() as mail:
        deliver(broker_with(burst), notify_env(tmp_path, mail.url()))
    [text] = mail.texts()
    assert [e.rcpt_tos for e in mail.messages] == [["oncall@example.com"]]
    assert "[CRITICAL] nan firing on run run-mail at step 4321" in text
    assert "16 ranks: 0, 1, 2, 3, 4, 5, 6, 7 and 8 more" in text


def test_a_critical_alert_runs_the_action_once_with_its_json_and_a_replay_does_not(tmp_path):
    out = tmp_path / "action.jsonl"
    script = tmp_path / "action.py"
    script.write_text("import json, os, sys\n"
                      "alert = json.load(sys.stdin)\n"
                      f"with open({str(out)!r}, 'a') as f:\n"
                      "    f.write(json.dumps([alert, os.environ['TRAINMON_ALERT_RULE']]) + '\\n')\n")
    critical = alert("run-h", "nan", "rank0", severity="critical", step=42)
    warning = alert("run-h", "grad_norm", "run", severity="warning")
    broker = broker_with([critical, warning, resolved(critical)])
    env = notify_env(tmp_path, notify_actions=f"critical={sys.executable} {script}")
    sink = deliver(broker, env)
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(a["incident_id"], a["step"], rule) for a, rule in runs] == [(critical.incident_id, 42, "nan")]
    assert sink.stats["actions"] == 1 and sink.stats["action_failures"] == 0
    deliver(broker, env, group="trainmon-notify-replay")
    assert len(out.read_text().splitlines()) == 1


def test_an_action_past_its_timeout_is_killed_and_counted(tmp_path):
    critical = alert("run-i", "nan", "rank0")
    env = notify_env(tmp_path, notify_actions=f"critical={sys.executable} -c 'import time; time.sleep(60)'",
                     notify_action_timeout_s="0.5")
    sink = deliver(broker_with([critical]), env)
    assert sink.stats["actions"] == 1 and sink.stats["action_failures"] == 1


def test_messages_group_one_rule_of_one_run_and_skip_the_superseded_half_of_an_escalation():
    burst = nan_burst("r", 3) + [alert("r", "stall", "rank1", ranks=[1]), alert("s", "nan", "rank0")]
    superseded = alert("r", "loss_spike", "run", state="resolved", message="resolved (escalated, superseded by #2)")
    grouped = messages.group([*burst, superseded], dashboard_url="http://grafana:3000/d/trainmon")
    assert [(m.run_id, m.rule, m.state, len(m.alerts)) for m in grouped] == [
        ("r", "nan", "firing", 3), ("r", "stall", "firing", 1), ("s", "nan", "firing", 1)]
    assert "dashboard: http://grafana:3000/d/trainmon?var-run_id=r" in grouped[0].body


def test_the_repost_interval_must_be_positive_and_a_short_one_is_kept():
    from trainmon.consumers.notify.config import ConfigError, load_config
    from trainmon.consumers.notify.sink import NotifySink

    with pytest.raises(ConfigError, match="TRAINMON_NOTIFY_REPOST_S"):
        load_config({"TRAINMON_NOTIFY_REPOST_S": "0"})
    assert NotifySink(load_config({"TRAINMON_NOTIFY_REPOST_S": "0.2"}), topic_prefix="t.").poll_s == 0.2
    assert NotifySink(load_config({}), topic_prefix="t.").poll_s == 1.0  # a minute: looked at every second


def test_a_delivery_marked_after_a_torn_line_survives_the_next_restart(tmp_path):
    """kill -9 mid-write leaves the delivered log ending in a torn line (no newline). The
    next process must not append its first line onto that torn one, or the delivery (and
    an action's at-most-once mark) is lost at the restart after: paged twice."""
    path = tmp_path / "delivered.jsonl"
    log = DeliveredLog(path)
    log.mark(["url-1#alert-a-firing"])
    log.close()
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"delivered": ["url-1#alert-b-fi')  # killed mid-write
    log = DeliveredLog(path)  # restart: the torn line is ignored
    assert "url-1#alert-a-firing" in log
    log.mark(["url-1#alert-c-firing"])  # delivered, marked
    log.set_firing({"incident_id": "r/nan/rank0#1", "event_id": "alert-c-firing"})
    log.close()
    again = DeliveredLog(path)  # the next restart
    assert "url-1#alert-c-firing" in again
    assert "r/nan/rank0#1" in again.firing
    again.close()


def test_a_url_gone_for_good_holds_back_the_next_page_once_not_once_per_message(tmp_path):
    """A dead URL and a live one; a burst of 10 incidents of different rules (10 messages),
    then one more incident. The runtime retries the flush before it reads anything new, so
    the next incident waits until the dead URL's messages are given up. Given up one
    message at a time, each after give_up_after_s of its own failures, the next page waits
    10 x give_up_after_s (with the default 600 s: 100 minutes with nobody paged for
    anything); the URL is known dead after the first give_up_after_s."""
    give_up_s = 0.5
    burst = [alert("run-z", f"rule{i}", "run", severity="warning") for i in range(10)]
    later = alert("run-y", "nan", "rank0")
    with WebhookServer() as hook:
        hook.received.refuse = 10**6  # the dead URL's server (told apart from the live one by port)
        dead = f"json://127.0.0.1:{hook.port}/dead"
        with WebhookServer() as live:
            env = notify_env(tmp_path, f"{dead} {live.json_url()}",
                             notify_give_up_after_s=str(give_up_s), notify_rate_per_min="100")
            broker = broker_with(burst)
            started = time.monotonic()
            sink = deliver(broker, env)  # (returns once the burst's flush went through)
            took = time.monotonic() - started
            broker_with([later], broker)
            deliver(broker, env)
    assert later.event_id in live.received.event_ids()
    assert sink.stats["given_up"] == 10
    assert took < 4 * give_up_s, f"the next page waited {took:.1f} s behind a dead URL"


def test_a_url_given_up_on_is_waited_for_again_at_its_next_outage(tmp_path, monkeypatch):
    """Failing since is per URL until a delivery there succeeds; but a URL given up on and
    without a failure since for NEW_OUTAGE_AFTER_S starts a new outage: its next failure is
    retried for give_up_after_s again, not given up after one try."""
    from trainmon.consumers.notify import sink as sink_module
    from trainmon.consumers.notify.config import load_config
    from trainmon.consumers.notify.sink import NotifySink

    now = [1000.0]
    monkeypatch.setattr(sink_module.time, "monotonic", lambda: now[0])
    sink = NotifySink(load_config(notify_env(tmp_path, notify_give_up_after_s="10")), topic_prefix="t.")
    assert not sink._give_up("url", "first message")  # the outage starts
    now[0] += 6
    assert not sink._give_up("url", "first message")  # retried (the runtime's backoff)
    now[0] += 5
    assert sink._give_up("url", "first message")  # failing for 11 s: given up
    now[0] += 1
    assert sink._give_up("url", "second message")  # the same outage: one try
    now[0] += sink_module.NEW_OUTAGE_AFTER_S + 1  # nothing failed there since
    assert not sink._give_up("url", "third message")  # a new outage: waited for again
    now[0] += 5
    assert not sink._give_up("url", "third message")
