"""The SQL endpoint (ClickHouse's HTTP interface over chDB) refuses what a ClickHouse server
refuses (INTO OUTFILE; KILL from a read-only user), answers an error instead of dropping
the connection, and takes binary INSERT bodies and format names as a server does. Each
once went otherwise. An endpoint on an in-process chDB directory: no broker, no service."""

from __future__ import annotations

import base64
import http.client as http_client
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest

from trainmon.consumers.clickhouse.client import Target, connect
from trainmon.consumers.clickhouse.native_wire import BLOCK_INFO
from trainmon.consumers.clickhouse.sql_endpoint import SqlEndpoint

pytest.importorskip("chdb")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("endpoint") / "chdb"
    client = connect(Target(path=path, database="trainmon"))
    client.command("CREATE DATABASE IF NOT EXISTS trainmon")
    client.command("CREATE TABLE IF NOT EXISTS trainmon.t (a Int64) ENGINE = MergeTree ORDER BY a")
    client.database = "trainmon"
    live = SqlEndpoint(client, path, database="trainmon").start()
    try:
        yield live
    finally:
        live.stop()
        client.close()


def http(endpoint, sql=None, *, params=None, user="viewer", method=None):
    """(status, headers, body) of one request; (None, None, repr) when no answer came."""
    info = endpoint.info()
    password = info["viewer_password"] if user == "viewer" else info["password"]
    url = info["url"] + ("?" + urllib.parse.urlencode(params) if params else "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(url, data=sql.encode() if sql is not None else None,
                                     method=method, headers={"Authorization": f"Basic {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()
    except (http_client.HTTPException, ConnectionError) as exc:
        return None, None, repr(exc)


def test_into_outfile_is_refused_over_http(endpoint, tmp_path):
    """A server refuses INTO OUTFILE over HTTP (INTO_OUTFILE_NOT_ALLOWED); chDB, being
    clickhouse-local, writes the file -- so the read-only viewer (and a GET) could write
    files on the service's host with the service's rights."""
    for user, method, target in (("viewer", "POST", tmp_path / "viewer.txt"),
                                 ("trainmon", "GET", tmp_path / "get.txt")):
        sql = f"SELECT 'written' INTO OUTFILE '{target}' FORMAT RawBLOB"
        if method == "GET":
            status, headers, body = http(endpoint, params={"query": sql}, user=user, method="GET")
        else:
            status, headers, body = http(endpoint, sql, user=user)
        assert not target.exists(), f"{user} {method} wrote {target}"
        assert status == 500 and headers["X-ClickHouse-Exception-Code"] == "358", body
        assert b"(INTO_OUTFILE_NOT_ALLOWED)" in body
    # ClickHouse's comments nest: what follows this one is a SELECT, not an INSERT.
    target = tmp_path / "nested.txt"
    status, headers, body = http(endpoint, f"/* /* */ INSERT */ SELECT 1 INTO OUTFILE '{target}'")
    assert not target.exists() and headers["X-ClickHouse-Exception-Code"] == "358", body
    # An INSERT's data may say "into outfile".
    assert http(endpoint, "CREATE TABLE IF NOT EXISTS lines (s String) ENGINE = Memory", user="trainmon")[0] == 200
    status, _, body = http(endpoint, "INSERT INTO lines FORMAT TSV\nwritten into outfile x\n", user="trainmon")
    assert status == 200, body


def test_the_viewer_cannot_kill_other_users_queries(endpoint):
    """chDB runs every query as its one user: a readonly viewer's KILL QUERY cancelled the
    service user's query (and would the loader's inserts), which a server's readonly user
    without the KILL QUERY grant cannot do."""
    done = {}

    def victim():
        done["answer"] = http(endpoint, "SELECT sum(sleepEachRow(0.25)) AS slow FROM numbers(8)",
                              user="trainmon")

    thread = threading.Thread(target=victim)
    thread.start()
    try:
        for _ in range(50):  # until the victim runs
            running = http(endpoint, "SELECT count() FROM system.processes WHERE query LIKE "
                                     "'%sleepEachRow(0.25)%' AND query NOT LIKE '%processes%'",
                           user="trainmon")[2]
            if running.strip() != b"0":
                break
            threading.Event().wait(0.05)
        status, headers, body = http(endpoint, "KILL QUERY WHERE query LIKE '%sleepEachRow(0.25)%' "
                                               "AND query NOT LIKE '%KILL%' SYNC")
    finally:
        thread.join(30)
    assert done["answer"][0] == 200, done["answer"][2]
    assert headers["X-ClickHouse-Exception-Code"] == "164" and b"(READONLY)" in body, body
    status, headers, body = http(endpoint, "/* /* */ SELECT */ KILL QUERY WHERE 0")
    assert headers["X-ClickHouse-Exception-Code"] == "164", body


def test_a_native_column_it_cannot_reframe_comes_back_as_an_error(endpoint):
    """Native for a client_protocol_version (clickhouse-go always sends one) of a column
    whose size native_for_revision cannot find: the handler thread died and the client got
    its connection closed with no answer at all, instead of ClickHouse's error text."""
    status, headers, body = http(endpoint, "SELECT sumState(toUInt8(1)) AS s FORMAT Native",
                                 params={"client_protocol_version": "54460"})
    assert status is not None, f"no answer: {body}"
    assert status == 500 and "X-ClickHouse-Exception-Code" in headers and body.startswith(b"Code: ")
    # The connection's server goes on answering.
    assert http(endpoint, "SELECT 1")[::2] == (200, b"1\n")


def test_a_lowercase_native_format_gets_the_revisions_block_info(endpoint):
    """ClickHouse's format names are case-insensitive (chDB renders `FORMAT native` as
    Native), but the endpoint compared with "Native" and sent no block info for the
    client's revision."""
    status, _, body = http(endpoint, "SELECT 1 AS a FORMAT native",
                           params={"client_protocol_version": "54405"})
    assert status == 200 and body.startswith(BLOCK_INFO), body


def test_the_service_user_inserts_binary_formats_intact(endpoint):
    """The body of an INSERT is data: clickhouse-connect's insert sends Native in it, and
    the endpoint decoded it as UTF-8 with replacement before handing it to chDB, so any
    value with a byte >= 0x80 (a negative number, most floats) broke the insert."""
    clickhouse_connect = pytest.importorskip("clickhouse_connect")
    info = endpoint.info()
    url = urllib.parse.urlsplit(info["url"])
    writer = clickhouse_connect.get_client(host=url.hostname, port=url.port, username="trainmon",
                                           password=info["password"], database="trainmon")
    try:
        writer.command("CREATE TABLE IF NOT EXISTS bin_scratch (a Int64, f Float64, s String) "
                       "ENGINE = MergeTree ORDER BY a")
        rows = [(-1, 0.1, "é"), (5, 2.5, "ok")]
        writer.insert("bin_scratch", rows, column_names=["a", "f", "s"])
        assert writer.query("SELECT a, f, s FROM bin_scratch ORDER BY a").result_rows == rows
        writer.command("DROP TABLE bin_scratch")
    finally:
        writer.close()
