"""Deployment settings at their edges, each once wrong: GRAFANA_URL behind a proxy's
sub-path or malformed, a broker certificate for hosts given at a later start, the
provisioned data source's CA without the broker's key, a bad TRAINMON_BROKER_PORT, a
metrics port out of range, the Grafana forwarder alone with --metrics-port."""

from __future__ import annotations

import re
import threading

import pytest

from trainmon.consumers.alerts import AlertEngine, load_config
from trainmon.consumers.alerts.grafana import GrafanaAnnotations, GrafanaForwarder
from trainmon.stack_security import StackSecrets

from .alerts_support import past_t0, synthetic_run
from .grafana_stub import GrafanaStub

TOKEN = "glsa_deploy_edges"


def one_firing(run_id="gj"):
    engine = AlertEngine(load_config(env={"TRAINMON_ALERT_NON_FINITE_COOLDOWN_S": "0"}))

    def nan_at_10(s, r, step, gpu, moe):
        if s == 10:
            step["loss"] = float("nan")

    out = []
    for record in synthetic_run(run_id, t0=past_t0(900), steps=40, mutate=nan_at_10, end=False):
        out.extend(engine.process(record))
    return out[0]


class SubPathGrafana(GrafanaStub):
    """Grafana served from a sub-path (root_url .../grafana/, serve_from_sub_path): only
    /grafana/... exists, as behind a reverse proxy."""

    def _app(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if not path.startswith("/grafana/"):
            start_response("404 Not Found", [("Content-Type", "application/json")])
            return [b'{"message": "Not found"}']
        environ["PATH_INFO"] = path[len("/grafana"):]
        return super()._app(environ, start_response)


def test_grafana_url_with_a_sub_path_reaches_grafana():
    """GRAFANA_URL=https://host/grafana (no trailing slash) must not become .../grafanaapi/...,
    a 404 the forwarder (404 being retryable) would retry for ever."""
    firing = one_firing()
    with SubPathGrafana(token=TOKEN) as stub:
        ann_id = GrafanaAnnotations(stub.url + "/grafana", TOKEN).send(firing)
        assert stub.annotations[ann_id]["time"] == int(firing.time.timestamp() * 1000)
        assert stub.violations == []


@pytest.mark.parametrize("url", ["grafana:3000", "localhost:3000", "http://grafana:30o0", "ftp://grafana:3000"])
def test_a_malformed_grafana_url_is_refused_at_start_naming_the_variable(url):
    with pytest.raises(SystemExit, match="GRAFANA_URL"):
        GrafanaForwarder.from_env(load_config(env={}), env={"GRAFANA_URL": url, "GRAFANA_TOKEN": TOKEN})


# -- certificates ---------------------------------------------------------------------------


def _certificates(pem: bytes):
    from cryptography import x509

    blocks = re.findall(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", pem, re.S)
    return [x509.load_pem_x509_certificate(b) for b in blocks]


def _sans(cert) -> set[str]:
    from cryptography import x509

    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in san.get_values_for_type(x509.DNSName)} | \
           {str(v) for v in san.get_values_for_type(x509.IPAddress)}


def test_certificate_covers_a_host_given_at_a_later_start(tmp_path):
    """`trainmon up --listen 10.0.0.5`, down, then `up --listen 10.0.0.5 --public-host
    head.example`: the broker's certificate must name head.example (the bootstrap the jobs
    get), and the nodes keep their CA file."""
    from trainmon.stack_security import StackSecrets

    first = StackSecrets.ensure(tmp_path / "security", ["10.0.0.5", "10.0.0.5"])
    ca_before = first.ca_file.read_bytes()
    again = StackSecrets.ensure(tmp_path / "security", ["head.example", "10.0.0.5"])
    leaf = _certificates(again.broker_keystore.read_bytes())[0]
    assert {"head.example", "10.0.0.5"} <= _sans(leaf)
    assert again.ca_file.read_bytes() == ca_before
    ca = _certificates(ca_before)[0]
    leaf.verify_directly_issued_by(ca)
    assert again.broker_keystore.stat().st_mode & 0o777 == 0o600
    assert again.passwords == first.passwords


def test_same_hosts_keep_the_same_certificate(tmp_path):
    from trainmon.stack_security import StackSecrets

    first = StackSecrets.ensure(tmp_path / "security", ["10.0.0.5"])
    pem = first.broker_keystore.read_bytes()
    assert StackSecrets.ensure(tmp_path / "security", ["10.0.0.5"]).broker_keystore.read_bytes() == pem


# -- grafana provision ------------------------------------------------------------------------


def test_provisioned_data_source_ca_holds_no_private_key(tmp_path):
    """The secured stack's SQL endpoint serves the broker's PEM (key + chain): the data
    source's tlsCACert must take its certificates only, never the broker's private key."""
    import yaml

    from trainmon.grafana_provision import datasource_yaml
    from trainmon.stack_security import StackSecrets

    secrets = StackSecrets.ensure(tmp_path / "security", ["127.0.0.1"])
    info = {"url": "https://127.0.0.1:8443", "viewer": "viewer", "viewer_password": "pw",
            "tls_cert": str(secrets.broker_keystore)}
    text = datasource_yaml(info)
    assert "PRIVATE KEY" not in text
    [source] = yaml.safe_load(text)["datasources"]
    ca = source["secureJsonData"]["tlsCACert"]
    assert _certificates(ca.encode()) == _certificates(secrets.broker_keystore.read_bytes())


# -- the CLI ------------------------------------------------------------------------------------


def test_a_bad_broker_port_variable_is_named_not_a_traceback(tmp_path, monkeypatch, capsys):
    from trainmon import cli

    monkeypatch.setenv("TRAINMON_BROKER_PORT", "9o92")
    assert cli.main(["broker", "status", "--data-dir", str(tmp_path)]) == 2
    assert "TRAINMON_BROKER_PORT" in capsys.readouterr().err


# -- metrics ------------------------------------------------------------------------------------


def test_a_metrics_port_out_of_range_does_not_stop_the_service():
    from trainmon.consumers.metrics import ServiceMetrics

    metrics = ServiceMetrics("review")
    assert metrics.serve(70000) is None
    metrics.close()


def test_grafana_forwarder_alone_serves_its_metrics_port(monkeypatch):
    """`trainmon consume alerts --only grafana --metrics-port P` must serve metrics on P."""
    from trainmon.consumers import runtime
    from trainmon.consumers.alerts import grafana, service

    seen = {}
    monkeypatch.setattr(grafana, "serve", lambda sink, **kw: seen.update(kw))
    monkeypatch.setattr(runtime, "stop_on_signals", threading.Event)
    monkeypatch.setenv("GRAFANA_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    assert service.main(["--only", "grafana", "--metrics-port", "9471"]) == 0
    assert seen.get("metrics_port") == 9471


def test_an_operators_encrypted_or_wrong_tls_files_are_named_before_anything_starts(tmp_path, capsys):
    """`up --tls-key` with a passphrase-protected key ended in cryptography's TypeError
    traceback; a key or certificate that is not PEM, or a missing file, likewise."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from trainmon import stack

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "broker")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "locked.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret")))
    (tmp_path / "plain.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (tmp_path / "junk").write_text("not a pem\n")

    def up(cert_file: str, key_file: str) -> str:
        with pytest.raises(SystemExit) as exc:
            stack.main(["up", "--dir", str(tmp_path / "stack"), "--tls-cert", str(tmp_path / cert_file),
                        "--tls-key", str(tmp_path / key_file), "--tls-ca", str(tmp_path / "cert.pem")])
        assert exc.value.code == 2
        return capsys.readouterr().err

    assert f"--tls-key {tmp_path / 'locked.key'} is encrypted" in up("cert.pem", "locked.key")
    assert f"--tls-key {tmp_path / 'junk'} is not a PEM private key" in up("cert.pem", "junk")
    assert f"--tls-cert {tmp_path / 'junk'} is not a PEM certificate" in up("junk", "plain.key")
    assert f"--tls-key {tmp_path / 'missing'}: No such file" in up("cert.pem", "missing")
    assert not (tmp_path / "stack").exists()  # refused before anything was made
    assert StackSecrets.load_given(tmp_path / "cert.pem", tmp_path / "plain.key", tmp_path / "cert.pem")


def test_roundtrip_to_a_stacks_broker_uses_its_security_settings(monkeypatch, capsys):
    """`trainmon roundtrip` against TRAINMON_KAFKA_BOOTSTRAP sent without the SASL / TLS
    variables `trainmon up` prints: against a secured stack it could never connect."""
    from types import SimpleNamespace

    from trainmon import roundtrip

    secured = {"TRAINMON_KAFKA_BOOTSTRAP": "stack:9094", "TRAINMON_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
               "TRAINMON_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "TRAINMON_KAFKA_SASL_USERNAME": "writer",
               "TRAINMON_KAFKA_SASL_PASSWORD": "pw", "TRAINMON_KAFKA_SSL_CAFILE": "/ca.pem"}
    for name, value in secured.items():
        monkeypatch.setenv(name, value)
    seen = {}

    class Producer:
        def __init__(self, config):
            seen["producer"] = config.kafka

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def __getattr__(self, name):
            return lambda *args, **kwargs: True

    class Stream:
        def __init__(self, group, topic_prefix, env):
            seen["stream"] = env

        def poll(self, timeout_ms):
            return [SimpleNamespace(kind="run", record=None)] * 100  # (more than were sent: done)

        def close(self):
            pass

    monkeypatch.setattr(roundtrip, "Producer", Producer)
    monkeypatch.setattr(roundtrip, "RecordStream", Stream)
    assert roundtrip.main(["--ranks", "1", "--steps", "1"]) == 1  # (stand-ins: not what was sent)
    security = {k: v for k, v in secured.items() if k != "TRAINMON_KAFKA_BOOTSTRAP"}
    assert seen["producer"] == security
    assert seen["stream"] == secured

