"""The Grafana sink against a loopback server that validates each request against
Grafana's published OpenAPI spec (tests/grafana_stub.py): annotations and regions, the
auth header, 401, 5xx and slow answers retried without losing or doubling an alert."""

from __future__ import annotations

import threading
import time

import pytest
from grafana_client.client import GrafanaClientError, GrafanaServerError

from trainmon import topics
from trainmon.consumers.alerts import AlertEngine, load_config
from trainmon.consumers.alerts.alert_topic import AlertPublisher
from trainmon.consumers.runtime import RetryPolicy
from trainmon.consumers.alerts.grafana import (GrafanaAnnotations, GrafanaForwarder,
                                               annotation_tags, incident_tag)

from .alerts_support import past_t0, run_until_idle, send, service_env, synthetic_run, wait_for
from .grafana_stub import GrafanaStub

TOKEN = "glsa_trainmon_test"


def nan_at(*steps):
    def mutate(s, r, step, gpu, moe):
        if s in steps:
            step["loss"] = float("nan")
    return mutate


def engine_alerts(run_id="g1", steps=(10,)):
    """Real alerts: the engine's output for a run with NaN losses at ``steps``."""
    engine = AlertEngine(load_config(env={"TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "0"}))
    out = []
    for record in synthetic_run(run_id, t0=past_t0(900), steps=40, mutate=nan_at(*steps), end=False):
        out.extend(engine.process(record))
    return out


@pytest.fixture
def grafana():
    with GrafanaStub(token=TOKEN) as stub:
        yield stub


def assert_spec_clean(stub: GrafanaStub):
    assert stub.requests, "no request reached the stub"
    assert stub.violations == []
    assert all(auth == f"Bearer {TOKEN}" for _, _, _, auth in stub.requests)


def test_firing_becomes_an_annotation_and_resolved_closes_it_as_a_region(grafana):
    firing, resolved = engine_alerts()
    sink = GrafanaAnnotations(grafana.url, TOKEN)
    ann_id = sink.send(firing)
    ann = grafana.annotations[ann_id]
    assert ann["time"] == int(firing.time.timestamp() * 1000)
    assert set(ann["tags"]) == {"trainmon", "rule:non_finite", "severity:critical", "run_id:g1",
                                incident_tag(firing)}
    assert "loss is nan" in ann["text"] and ann["text"].startswith("[critical]")
    assert sink.send(resolved) == ann_id
    assert ann["timeEnd"] == int(resolved.time.timestamp() * 1000) > ann["time"]
    assert "Resolved:" in ann["text"]
    assert len(grafana.annotations) == 1
    methods = [(m, p.split("?")[0]) for m, p, _, _ in grafana.requests]
    assert ("POST", "/api/annotations") in methods and ("PATCH", f"/api/annotations/{ann_id}") in methods
    assert_spec_clean(grafana)


def test_sending_again_adds_nothing(grafana):
    firing, resolved = engine_alerts()
    sink = GrafanaAnnotations(grafana.url, TOKEN, dashboard_uid="trainmon-overview")
    first = sink.send(firing)
    assert sink.send(firing) == first
    sink.send(resolved)
    patches = sum(1 for m, *_ in grafana.requests if m == "PATCH")
    sink.send(resolved)
    assert sum(1 for m, *_ in grafana.requests if m == "PATCH") == patches
    assert len(grafana.annotations) == 1
    assert grafana.annotations[first]["dashboardUID"] == "trainmon-overview"
    assert_spec_clean(grafana)


def test_wrong_token_gets_401_and_says_which_setting(grafana):
    firing, _ = engine_alerts()
    with pytest.raises(GrafanaClientError) as exc:
        GrafanaAnnotations(grafana.url, "glsa_wrong").send(firing)
    assert exc.value.status_code == 401
    assert grafana.annotations == {} and grafana.violations == []


def test_server_error_is_raised_for_the_caller_to_retry(grafana):
    firing, _ = engine_alerts()
    grafana.fail_next = [503]
    with pytest.raises(GrafanaServerError):
        GrafanaAnnotations(grafana.url, TOKEN).send(firing)
    assert GrafanaAnnotations(grafana.url, TOKEN).send(firing) == 1


def test_a_token_is_required_from_the_environment():
    with pytest.raises(SystemExit, match="GRAFANA_TOKEN"):
        GrafanaForwarder.from_env(load_config(env={}), env={"GRAFANA_URL": "http://127.0.0.1:1"})


class ForwarderThread:
    def __init__(self, forwarder: GrafanaForwarder):
        self.forwarder = forwarder
        self.thread = threading.Thread(target=forwarder.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self.forwarder

    def __exit__(self, *exc):
        self.forwarder.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def forwarder(bootstrap, prefix, url, token, **config_env) -> GrafanaForwarder:
    env = {"TRAINMON_KAFKA_BOOTSTRAP": bootstrap, "GRAFANA_URL": url, "GRAFANA_TOKEN": token,
           "TRAINMON_ALERT_GRAFANA_GROUP_ID": f"{prefix}grafana",  # a group of its own per test
           **{f"TRAINMON_ALERT_{k.upper()}": str(v) for k, v in config_env.items()}}
    config = load_config(env=env)
    fwd = GrafanaForwarder.from_env(config, env=env)
    fwd.topic_prefix = prefix
    fwd.retry = RetryPolicy(0.05, 0.5)
    return fwd


def publish(bootstrap, prefix, alerts):
    publisher = AlertPublisher(topics.topic_for("alert", prefix), {"TRAINMON_KAFKA_BOOTSTRAP": bootstrap})
    publisher.publish(alerts)  # raises unless Kafka has them all
    publisher.close()


def test_rejected_token_loses_nothing_and_a_fixed_token_delivers_everything(bootstrap, topic_prefix, grafana):
    alerts = engine_alerts(steps=(10, 20))  # two incidents: four alerts
    assert len(alerts) == 4
    publish(bootstrap, topic_prefix, alerts)
    with ForwarderThread(forwarder(bootstrap, topic_prefix, grafana.url, "glsa_revoked")) as fwd:
        wait_for(lambda: fwd.failures >= 3, what="retries with the bad token")
        assert "401" in fwd.last_error and "GRAFANA_TOKEN" in fwd.last_error
    assert grafana.annotations == {} and fwd.delivered == 0
    # Restarted with a valid token, the same consumer group picks up every alert.
    with ForwarderThread(forwarder(bootstrap, topic_prefix, grafana.url, TOKEN)) as fwd:
        wait_for(lambda: fwd.delivered == 4, what="delivery after the token was fixed")
    regions = [a for a in grafana.annotations.values() if a["timeEnd"] > a["time"]]
    assert len(grafana.annotations) == 2 and len(regions) == 2
    assert grafana.violations == []


def test_grafana_down_and_slow_does_not_hold_up_the_engine(bootstrap, topic_prefix, make_producer,
                                                           grafana, tmp_path):
    """Grafana answers 5xx, then too slowly; meanwhile the engine detects and publishes.
    When Grafana recovers every alert arrives, once."""
    grafana.fail_next = [503, 502, 500]
    with ForwarderThread(forwarder(bootstrap, topic_prefix, grafana.url, TOKEN, grafana_timeout_s=0.5)) as fwd:
        grafana.delay_s = 2.0  # beyond the client's 0.5 s timeout
        send(make_producer(), synthetic_run("g2", t0=past_t0(900), steps=40, mutate=nan_at(10, 20)))
        started = time.monotonic()
        service = run_until_idle(service_env(bootstrap, non_finite_cooldown_s=0), topic_prefix,
                                 tmp_path / "state", idle_s=1.0)
        engine_seconds = time.monotonic() - started
        assert service.stats["alerts"] == 4  # two NaN incidents, fired and resolved
        wait_for(lambda: fwd.failures >= 4, what="failed attempts")
        assert fwd.delivered == 0
        grafana.delay_s = 0.0
        wait_for(lambda: fwd.delivered == 4, timeout=60, what="delivery after recovery")
    assert engine_seconds < 30
    tags = [tuple(sorted(a["tags"])) for a in grafana.annotations.values()]
    assert len(tags) == len(set(tags)) == 2, "an incident got two annotations"
    assert all(a["timeEnd"] > a["time"] for a in grafana.annotations.values())
    statuses_seen = [m for m, *_ in grafana.requests]
    assert len(statuses_seen) > 4 + 2  # the failed attempts reached the server too
    assert_spec_clean(grafana)


def test_tags_name_rule_severity_run_and_incident():
    firing, _ = engine_alerts(run_id="my-run")
    assert annotation_tags(firing)[:4] == ["trainmon", "rule:non_finite", "severity:critical", "run_id:my-run"]


def test_cli_runs_the_engine_and_the_grafana_forwarder(bootstrap, topic_prefix, make_producer, grafana,
                                                      tmp_path):
    import os
    import subprocess
    import sys

    send(make_producer(), synthetic_run("cli", t0=past_t0(900), steps=30, mutate=nan_at(10)))
    env = {**os.environ, "TRAINMON_KAFKA_BOOTSTRAP": bootstrap, "TRAINMON_TOPIC_PREFIX": topic_prefix,
           "TRAINMON_ALERT_STATE_DIR": str(tmp_path / "state"), "GRAFANA_URL": grafana.url,
           "GRAFANA_TOKEN": TOKEN, "TRAINMON_ALERT_GROUP_ID": f"{topic_prefix}alerts",
           "TRAINMON_ALERT_GRAFANA_GROUP_ID": f"{topic_prefix}grafana"}
    done = subprocess.run([sys.executable, "-m", "trainmon", "consume", "alerts", "--exit-when-idle", "3"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "state").glob("*.json.gz")), "no checkpoint written"
    assert len(grafana.annotations) == 1, done.stderr[-3000:]
    (annotation,) = grafana.annotations.values()
    assert "rule:non_finite" in annotation["tags"] and "run_id:cli" in annotation["tags"]
    assert annotation["timeEnd"] > annotation["time"]
    assert_spec_clean(grafana)
