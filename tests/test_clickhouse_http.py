"""The SQL endpoint of `trainmon consume clickhouse` on chDB speaks ClickHouse's HTTP
interface: real clients -- clickhouse-connect over HTTP, and clickhouse-go v2 (the
driver of Grafana's ClickHouse data source) through the small program in tests/chgo --
run every dashboard panel query, macros expanded, against the running service as the
read-only viewer and get the same rows as chDB queried directly; the viewer is refused
INSERT, DROP and settings changes; a wrong password is refused; a bad query comes back
with ClickHouse's code and text; `trainmon sql` still works; TLS beyond loopback."""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests import ch_values
from tests.clickhouse_service import REPO, ClickHouseService, run_trainmon, trainmon_env
from tests.dashboard_data import records
from tests.test_dashboards import all_queries
from trainmon.consumers.clickhouse import refresh_now
from trainmon.consumers.clickhouse.native_wire import compress_blocks, decompress_blocks
from trainmon.consumers.clickhouse.sql_endpoint import find_endpoint
from trainmon.producer import Producer, ProducerConfig

clickhouse_connect = pytest.importorskip("clickhouse_connect")

GO_PROGRAM = REPO / "tests" / "chgo"
# What a failed `go build` says when it could not fetch modules or the toolchain.
_GO_UNAVAILABLE = ("dial tcp", "no such host", "proxy.golang.org", "connection refused",
                   "i/o timeout", "requires go >=", "toolchain not available", "TLS handshake")


@pytest.fixture(scope="session")
def chgo(tmp_path_factory) -> Path:
    """tests/chgo built once per session; skipped, with the reason, without Go."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go is not installed: tests/chgo (clickhouse-go v2, the driver of Grafana's "
                    "ClickHouse data source) cannot be built")
    out = tmp_path_factory.mktemp("chgo") / "chgo"
    env = dict(os.environ, GOTOOLCHAIN="local", GOFLAGS="-buildvcs=false")
    done = subprocess.run([go, "build", "-o", str(out), "."], cwd=GO_PROGRAM, env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        if any(sign in done.stderr for sign in _GO_UNAVAILABLE):
            pytest.skip(f"tests/chgo could not fetch its modules or toolchain: {done.stderr[-500:]}")
        pytest.fail(f"tests/chgo does not build:\n{done.stderr[-3000:]}")
    return out


def run_go(binary: Path, info: dict, user: str, password: str, queries: dict | None = None,
           exec_: dict | None = None, compression: str = "lz4", **extra) -> dict:
    request = {"addr": urllib.parse.urlsplit(info["url"]).netloc, "user": user,
               "password": password, "database": "trainmon", "compression": compression,
               "queries": queries or {}, "exec": exec_ or {}, **extra}
    done = subprocess.run([str(binary)], input=json.dumps(request), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


# -- the running service, loaded through Kafka with the dashboards' data ----------------


@pytest.fixture(scope="module")
def service(bootstrap, tmp_path_factory):
    prefix = f"t{uuid.uuid4().hex[:10]}."
    work = tmp_path_factory.mktemp("chhttp")
    data = records()
    producer = Producer(ProducerConfig(bootstrap=bootstrap, topic_prefix=prefix, run_id="test-run",
                                       spill_dir=work / "spill", linger_ms=5))
    try:
        for record in data:
            producer.send_record(record)
        assert producer.flush(60)
    finally:
        producer.close(timeout=5)
    live = ClickHouseService(bootstrap, prefix, work / "chdb", work / "service.log").start()
    assert live.running(), live.log.read_text()[-3000:]
    try:
        for kind, count in Counter(record.kind for record in data).items():
            live.wait_for(f"SELECT count() FROM trainmon.{kind}", count, timeout=120)
        yield live
    finally:
        if live.running():
            live.stop()


@pytest.fixture(scope="module")
def info(service) -> dict:
    return find_endpoint(service.path)


def connect(info: dict, user: str = "viewer", password: str | None = None, **kw):
    if password is None:
        password = info["viewer_password"] if user == "viewer" else info["password"]
    url = urllib.parse.urlsplit(info["url"])
    return clickhouse_connect.get_client(host=url.hostname, port=url.port, interface=url.scheme,
                                         username=user, password=password, database="trainmon", **kw)


def http(info: dict, sql: str | None = None, *, params: dict | None = None, user="viewer",
         password: str | None = None, headers: dict | None = None, method: str | None = None,
         path: str = "", body: bytes | None = None):
    """One plain HTTP request: (status, headers, body)."""
    if password is None:
        password = info["viewer_password"] if user == "viewer" else info["password"]
    url = info["url"] + path + ("?" + urllib.parse.urlencode(params) if params else "")
    all_headers = dict(headers or {})
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        all_headers.setdefault("Authorization", f"Basic {token}")
    data = body if body is not None else sql.encode() if sql is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=all_headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


# -- the HTTP interface itself ------------------------------------------------------------


def test_endpoint_file_and_users_are_private(service, info):
    assert info["url"].startswith("http://127.0.0.1:")
    assert info["user"] == "trainmon" and info["viewer"] == "viewer"
    for name in ("sql-endpoint.json", "sql-users.json"):
        assert (service.path / name).stat().st_mode & 0o777 == 0o600


def test_ping_query_parameter_formats_and_settings(info):
    assert http(info, path="ping", user=None)[::2] == (200, b"Ok.\n")
    assert http(info, user=None)[::2] == (200, b"Ok.\n")  # GET / without a query
    status, headers, body = http(info, params={"query": "SELECT count() FROM step"})
    assert (status, body) == (200, b"204\n")
    assert headers["X-ClickHouse-Format"] == "TabSeparated" and "X-ClickHouse-Summary" in headers
    # query= and body together: the parameter first, as ClickHouse does.
    assert http(info, "FROM step", params={"query": "SELECT count()"})[2] == b"204\n"
    status, headers, body = http(info, "SELECT 1 AS a, 'x' AS b", params={"default_format": "JSONEachRow"})
    assert body == b'{"a":1,"b":"x"}\n' and headers["X-ClickHouse-Format"] == "JSONEachRow"
    assert http(info, "SELECT 1 AS a FORMAT RowBinaryWithNamesAndTypes")[2] == b"\x01\x01a\x05UInt8\x01"
    assert http(info, "SELECT 1 AS a", params={"default_format": "Native"})[2] == b"\x01\x01\x01a\x05UInt8\x01"
    assert http(info, "SELECT {n:UInt8} * 2", params={"param_n": "21"})[2] == b"42\n"
    assert http(info, "SELECT currentDatabase()", params={"database": "system"})[2] == b"system\n"
    # A setting as a URL parameter, for the service user; the viewer may change only
    # max_execution_time (changeable_in_readonly).
    sql = "SELECT getSetting('max_threads'), getSetting('max_execution_time')"
    assert http(info, sql, user="trainmon", params={"max_threads": "1"})[2] == b"1\t0\n"
    assert http(info, sql, params={"max_execution_time": "7"})[2].endswith(b"\t7\n")
    status, headers, body = http(info, sql, params={"max_threads": "1"})
    assert status == 500 and headers["X-ClickHouse-Exception-Code"] == "164"
    assert b"Cannot modify 'max_threads' setting in readonly mode" in body


def test_compression_both_ways(info):
    sql = "SELECT number FROM numbers(1000)"
    plain = http(info, sql)[2]
    status, headers, body = http(info, sql, params={"compress": "1"})
    assert status == 200 and decompress_blocks(body) == plain
    status, headers, body = http(info, sql, params={"enable_http_compression": "1"},
                                 headers={"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip" and gzip.decompress(body) == plain
    # Without enable_http_compression ClickHouse ignores Accept-Encoding.
    assert http(info, sql, headers={"Accept-Encoding": "gzip"})[2] == plain
    assert http(info, body=gzip.compress(sql.encode()), headers={"Content-Encoding": "gzip"})[2] == plain
    assert http(info, body=compress_blocks(sql.encode()), params={"decompress": "1"})[2] == plain
    status, headers, body = http(info, body=b"x" * 40, params={"decompress": "1"})
    assert status == 500 and headers["X-ClickHouse-Exception-Code"] in ("40", "271")


def test_errors_come_back_as_clickhouse_returns_them(info):
    status, headers, body = http(info, "SELEC 1")
    assert (status, headers["X-ClickHouse-Exception-Code"]) == (400, "62")
    assert body.startswith(b"Code: 62. DB::Exception: Syntax error") and body.endswith(b"(SYNTAX_ERROR)\n")
    status, headers, body = http(info, "SELECT * FROM no_such_table")
    assert (status, headers["X-ClickHouse-Exception-Code"]) == (404, "60")
    status, headers, body = http(info, "SELECT 1", password="wrong")
    assert (status, headers["X-ClickHouse-Exception-Code"]) == (403, "516")
    assert body == (b"Code: 516. DB::Exception: viewer: Authentication failed: password is incorrect, "
                    b"or there is no user with such name. (AUTHENTICATION_FAILED)\n")
    assert http(info, "SELECT 1", user=None)[0] == 403  # no credentials: user "default", none here
    # X-ClickHouse-User / -Key, and not mixed with basic auth.
    key = {"X-ClickHouse-User": "viewer", "X-ClickHouse-Key": info["viewer_password"]}
    assert http(info, "SELECT 1", user=None, headers=key)[::2] == (200, b"1\n")
    assert http(info, "SELECT 1", headers=key)[0] == 401
    assert http(info, "SELECT 1", user=None, params={"user": "viewer",
                                                     "password": info["viewer_password"]})[2] == b"1\n"


def test_the_viewer_reads_and_changes_nothing(info):
    for statement in ("INSERT INTO step (run_id) VALUES ('x')", "DROP TABLE step",
                      "CREATE TABLE t (a Int8) ENGINE = Memory", "ALTER TABLE step DELETE WHERE 1",
                      "SET max_threads = 1", "SELECT * FROM file('/etc/hostname', 'LineAsString')"):
        status, headers, body = http(info, statement)
        assert headers["X-ClickHouse-Exception-Code"] == "164", (statement, body)
        assert b"(READONLY)" in body
    # A GET query is readonly for every user, as on a server.
    status, headers, body = http(info, user="trainmon", params={"query": "CREATE TABLE t (a Int8) ENGINE = Memory"})
    assert headers["X-ClickHouse-Exception-Code"] == "164"
    assert http(info, "SELECT count() FROM step")[2] == b"204\n"


def test_clickhouse_connect_over_http(info):
    for compress in (True, False, "zstd", "gzip"):
        client = connect(info, compress=compress)
        try:
            assert client.command("SELECT count() FROM step") == 204
            assert client.query("SELECT max(step) FROM step").result_rows == [(29,)]
            for statement in ("DROP TABLE step", "INSERT INTO step (run_id) VALUES ('x')"):
                with pytest.raises(clickhouse_connect.driver.exceptions.DatabaseError,
                                   match=r"Code: 164\. DB::Exception: viewer: Cannot execute query in readonly mode"):
                    client.command(statement)
            with pytest.raises(clickhouse_connect.driver.exceptions.DatabaseError) as bad:
                client.query("SELECT no_such_column FROM step")
            assert bad.value.code == 47 and "DB::Exception: Unknown expression identifier" in str(bad.value)
        finally:
            client.close()
    with pytest.raises(clickhouse_connect.driver.exceptions.DatabaseError, match="Code: 516.*AUTHENTICATION_FAILED"):
        connect(info, password="wrong")
    writer = connect(info, user="trainmon")  # the services' own user may write
    try:
        writer.command("CREATE TABLE IF NOT EXISTS http_scratch (a Int8) ENGINE = Memory")
        writer.insert("http_scratch", [[1], [2]], column_names=["a"])
        assert writer.command("SELECT sum(a) FROM http_scratch") == 3
        writer.command("DROP TABLE http_scratch")
    finally:
        writer.close()


def test_clickhouse_go_refusals_and_errors(chgo, info):
    for compression in ("lz4", "gzip", "none"):
        out = run_go(chgo, info, "viewer", info["viewer_password"], compression=compression,
                     queries={"count": "SELECT count() FROM step", "bad": "SELECT no_such_column FROM step",
                              "syntax": "SELEC 1"},
                     exec_={"drop": "DROP TABLE step", "insert": "INSERT INTO step (run_id) VALUES ('x')"})
        assert out["count"]["rows"] == [[204]]
        assert out["bad"]["code"] == 47 and "Unknown expression identifier" in out["bad"]["message"]
        assert out["syntax"]["code"] == 62 and out["syntax"]["message"].startswith("Syntax error")
        for refused in ("drop", "insert"):
            assert out[refused]["code"] == 164, out[refused]
            assert "viewer: Cannot execute query in readonly mode" in out[refused]["message"]
    wrong = run_go(chgo, info, "viewer", "wrong", queries={"one": "SELECT 1"})
    assert wrong["connect"]["code"] == 516 and "Authentication failed" in wrong["connect"]["message"]


def test_trainmon_sql_still_works(service):
    done = run_trainmon(service.bootstrap, "sql", "--path", str(service.path), "-f", "csv",
                        "SELECT count() AS n FROM step")
    assert done.returncode == 0 and done.stdout == '"n"\n204\n', done.stderr
    done = run_trainmon(service.bootstrap, "sql", "--path", str(service.path), "SELEC 1")
    assert done.returncode == 1 and "Code: 62. DB::Exception: Syntax error" in done.stderr


# -- Grafana ------------------------------------------------------------------------------


def test_grafana_provision_for_the_running_stack(service, info, tmp_path, request):
    """Everything up to Grafana itself (which cannot be installed here): the files, and
    the provisioned data source's settings used by Grafana's driver."""
    import yaml

    from trainmon.grafana_sql import TimeRange, expand
    from tests.test_dashboards import ALERT_RULES, DASHBOARDS, TIME

    out = tmp_path / "grafana"
    done = subprocess.run([sys.executable, "-m", "trainmon.grafana_provision", "provision",
                           "--out", str(out), "--path", str(service.path)],
                          capture_output=True, text=True, cwd=REPO, env=trainmon_env(service.bootstrap),
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "grafana.sh" in done.stdout
    source_file = out / "provisioning" / "datasources" / "trainmon.yaml"
    assert source_file.stat().st_mode & 0o777 == 0o600 and out.stat().st_mode & 0o777 == 0o700
    [source] = yaml.safe_load(source_file.read_text())["datasources"]
    assert source["type"] == "grafana-clickhouse-datasource" and source["uid"] == "trainmon-clickhouse"
    settings = source["jsonData"]
    assert (settings["protocol"], settings["secure"], settings["username"]) == ("http", False, "viewer")
    assert f"{settings['host']}:{settings['port']}" == urllib.parse.urlsplit(info["url"]).netloc
    assert source["secureJsonData"]["password"] == info["viewer_password"]
    for dashboard in DASHBOARDS:  # every dashboard, panel and the alert rule use this source
        assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {source["uid"]}
    assert {q["datasourceUid"] for rule in ALERT_RULES for q in rule["data"]} == {source["uid"], "__expr__"}
    dashboards = {p.name: p.read_text() for p in (out / "dashboards").glob("*.json")}
    assert dashboards == {p.name: p.read_text() for p in (REPO / "trainmon/grafana/dashboards").glob("*.json")}
    [provider] = yaml.safe_load((out / "provisioning/dashboards/trainmon.yaml").read_text())["providers"]
    assert provider["options"]["path"] == str(out / "dashboards")
    rules = yaml.safe_load((out / "provisioning/alerting/trainmon.yaml").read_text())
    assert [r["uid"] for g in rules["groups"] for r in g["rules"]] == [r["uid"] for r in ALERT_RULES]
    script = (out / "grafana.sh").read_text()
    assert f"GF_PATHS_PROVISIONING={out / 'provisioning'}" in script and "grafana server" in script
    # Grafana's driver with exactly the provisioned settings: the run variable, a panel
    # and the alert rule's query.
    try:
        binary = request.getfixturevalue("chgo")
    except pytest.skip.Exception as exc:
        pytest.skip(f"files checked; the driver check needs Go: {exc}")
    queries = {"variable": DASHBOARDS[0]["templating"]["list"][0]["query"],
               "rule": expand(ALERT_RULES[0]["data"][0]["model"]["rawSql"], TIME),
               "panel": expand("SELECT count() FROM step WHERE $__timeFilter(time)", TimeRange(TIME.start, TIME.end))}
    request_ = {"addr": f"{settings['host']}:{settings['port']}", "user": settings["username"],
                "password": source["secureJsonData"]["password"], "database": settings["defaultDatabase"],
                "compression": "lz4", "queries": queries, "exec": {}}
    ran = subprocess.run([str(binary)], input=json.dumps(request_), capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    got = json.loads(ran.stdout)
    assert sorted(row[0] for row in got["variable"]["rows"]) == ["dash-big", "dash-run"], got
    assert len(got["rule"]["rows"]) == 2 and got["panel"]["rows"] == [[204]], got


# -- beyond loopback: TLS ----------------------------------------------------------------


def test_listening_beyond_loopback_needs_tls(tmp_path):
    done = run_trainmon("127.0.0.1:1", "consume", "clickhouse", "--path", str(tmp_path / "chdb"),
                        "--listen", "0.0.0.0:0", timeout=120)
    assert done.returncode == 2 and "beyond loopback" in done.stderr and "--tls-cert" in done.stderr
    assert not (tmp_path / "chdb" / "sql-endpoint.json").exists()


@pytest.fixture
def certificate(tmp_path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: no certificate for the TLS test")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls(bootstrap, tmp_path, certificate, request):
    cert, key = certificate
    prefix = f"t{uuid.uuid4().hex[:10]}."
    tls = ClickHouseService(bootstrap, prefix, tmp_path / "chdb", tmp_path / "service.log")
    tls.start("--listen", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert tls.running(), tls.log.read_text()[-3000:]
        info = find_endpoint(tls.path)
        assert info["url"].startswith("https://127.0.0.1:")
        client = connect(info, ca_cert=str(cert))
        assert client.command("SELECT 1 + 1") == 2
        # Not closed: clickhouse-connect's close() of an HTTPS pool trips over the
        # urllib3-future installed here ('TrafficPolice' object has no attribute 'lock').
        done = run_trainmon(bootstrap, "sql", "--path", str(tls.path), "-f", "csv", "SELECT 3 AS n")
        assert done.returncode == 0 and done.stdout == '"n"\n3\n', done.stderr
        plain = info["url"].replace("https:", "http:")
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(plain + "ping", timeout=10).read()
        try:
            binary = request.getfixturevalue("chgo")
        except pytest.skip.Exception:
            return
        out = run_go(binary, info, "viewer", info["viewer_password"], tls=True, ca_file=str(cert),
                     queries={"one": "SELECT 1 AS one"})
        assert out["one"]["rows"] == [[1]], out
    finally:
        assert tls.stop() == 0


# -- every dashboard panel, through each client, against chDB read directly --------------


@pytest.fixture(scope="module")
def panels(service, info, request) -> dict:
    """Every panel query as the viewer: through clickhouse-connect over HTTP and (when Go
    is here) clickhouse-go while the service runs; then the service stops and the same
    directory is read directly with chDB."""
    queries = all_queries()
    results: dict = {"queries": queries, "http": {}, "go": None, "go_skip": None}
    admin = connect(info, user="trainmon")
    try:  # the goodput panel's table, recomputed now: the same rows whoever reads it later
        refresh_now(admin)
    finally:
        admin.close()
    client = connect(info, compress=True)
    try:
        for name, sql in queries.items():
            try:
                result = client.query(sql)
                results["http"][name] = {"columns": list(result.column_names),
                                         "rows": ch_values.rows(result.result_rows)}
            except Exception as exc:  # noqa: BLE001 - reported per query
                results["http"][name] = {"error": str(exc)}
    finally:
        client.close()
    try:
        binary = request.getfixturevalue("chgo")
    except pytest.skip.Exception as exc:
        results["go_skip"] = str(exc)
    else:
        out = run_go(binary, info, "viewer", info["viewer_password"], queries=queries)
        assert "connect" not in out, out.get("connect")
        results["go"] = {name: ch_values.go_result(r) for name, r in out.items()}
    assert service.stop() == 0
    direct = subprocess.run([sys.executable, "-m", "tests.chdb_direct_sql", str(service.path), "trainmon"],
                            input=json.dumps(queries), capture_output=True, text=True, cwd=REPO,
                            env=trainmon_env(service.bootstrap), timeout=600)
    assert direct.returncode == 0, direct.stderr[-3000:]
    results["direct"] = json.loads(direct.stdout)
    return results


# Columns that depend on the time a query runs (latest_step's now64()): the live clients
# read before chDB is read directly, so those values are smaller by at most the time
# between, and compared apart from the rest of the row.
NOW_COLUMNS = ("seconds_since",)
WINDOW_S = 900


def _split_now(result: dict) -> tuple[dict, list]:
    if "error" in result or not set(NOW_COLUMNS) & set(result["columns"]):
        return result, []
    keep = [i for i, c in enumerate(result["columns"]) if c not in NOW_COLUMNS]
    drop = [i for i, c in enumerate(result["columns"]) if c in NOW_COLUMNS]
    pairs = sorted((([row[i] for i in keep], [row[i] for i in drop]) for row in result["rows"]),
                   key=lambda pair: json.dumps(pair, sort_keys=True))
    return ({"columns": [result["columns"][i] for i in keep], "rows": [p[0] for p in pairs]},
            [p[1] for p in pairs])


def _differences(got: dict, want: dict) -> dict:
    diff = {}
    for name, expected in want.items():
        mine, mine_now = _split_now(got.get(name) or {"error": "missing"})
        theirs, theirs_now = _split_now(expected)
        later = all(0 <= b - a <= WINDOW_S for x, y in zip(mine_now, theirs_now) for a, b in zip(x, y)
                    if isinstance(a, float) and isinstance(b, float))
        if mine != theirs or len(mine_now) != len(theirs_now) or not later:
            diff[name] = {"got": got.get(name), "want": expected}
    return diff


def test_every_panel_reads_the_same_over_clickhouse_connect_http(panels):
    direct = panels["direct"]
    assert [name for name, r in direct.items() if "error" in r] == []
    assert sum(bool(r["rows"]) for r in direct.values()) > len(direct) / 2
    diff = _differences(panels["http"], direct)
    assert diff == {}, json.dumps(dict(list(diff.items())[:3]), indent=1)[:4000]


def test_every_panel_reads_the_same_over_clickhouse_go(panels):
    if panels["go"] is None:
        pytest.skip(panels["go_skip"])
    diff = _differences(panels["go"], panels["direct"])
    assert diff == {}, json.dumps(dict(list(diff.items())[:3]), indent=1)[:4000]
