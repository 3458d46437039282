"""SQL for other processes while a service holds the embedded engine.

chDB runs inside one process and locks its data directory, so while ``trainmon consume
clickhouse`` (or ``trainmon replay``) runs on a path, no other process can open that
path. The service therefore answers SQL on a loopback HTTP port: ``POST /`` with the SQL
as body, ``?default_format=<ClickHouse format>``, and header ``X-Trainmon-Token``. The
URL and token are written to ``<data dir>/sql-endpoint.json`` (mode 0600, so only users
who may read the data may query it) and removed at shutdown. ``trainmon sql`` uses the
file when its process is alive, and otherwise opens the directory itself.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from clickhouse_connect.driver.exceptions import Error as ClickHouseError

log = logging.getLogger("trainmon.clickhouse")
ENDPOINT_FILE = "sql-endpoint.json"
TOKEN_HEADER = "X-Trainmon-Token"


class SqlQueryError(RuntimeError):
    """ClickHouse refused the query; the message is ClickHouse's."""


def run_sql(client, sql: str, fmt: str, settings: dict | None = None) -> bytes:
    """The one way trainmon runs a person's SQL: ClickHouse renders the format."""
    try:
        return client.raw_query(sql, fmt=fmt, settings=settings)
    except ClickHouseError as exc:
        raise SqlQueryError(str(exc).strip()) from exc


class SqlEndpoint:
    def __init__(self, client, data_dir: Path):
        self.client = client
        self.file = Path(data_dir) / ENDPOINT_FILE
        self.token = secrets.token_urlsafe(24)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="sql-endpoint",
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> "SqlEndpoint":
        self._thread.start()
        tmp = self.file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.url, "token": self.token, "pid": os.getpid()}, f)
        os.replace(tmp, self.file)
        log.info("answering SQL for other processes on %s", self.url)
        return self

    def stop(self) -> None:
        try:
            self.file.unlink()
        except FileNotFoundError:
            pass
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                if not secrets.compare_digest(self.headers.get(TOKEN_HEADER, ""), endpoint.token):
                    return self._reply(403, b"bad or missing " + TOKEN_HEADER.encode())
                # Like ClickHouse's HTTP interface: other parameters are settings.
                params = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(self.path).query))
                fmt = params.pop("default_format", "TabSeparatedWithNames")
                sql = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                try:
                    body = run_sql(endpoint.client, sql, fmt, params or None)
                except SqlQueryError as exc:
                    return self._reply(500, str(exc).encode())
                self._reply(200, body)

            def _reply(self, status: int, body: bytes):
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        return Handler


def find_endpoint(data_dir: Path) -> dict | None:
    """The running service's endpoint for ``data_dir``, or None when there is none."""
    try:
        info = json.loads((Path(data_dir) / ENDPOINT_FILE).read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no file, or its process is gone (e.g. killed with -9)
    return info


def query_endpoint(info: dict, sql: str, fmt: str, settings: dict | None = None,
                   timeout: float = 300.0) -> bytes:
    """Run SQL on a service's endpoint; URLError when it does not answer."""
    url = info["url"] + "?" + urllib.parse.urlencode({"default_format": fmt, **(settings or {})})
    request = urllib.request.Request(url, data=sql.encode(), method="POST",
                                     headers={TOKEN_HEADER: info["token"]})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        raise SqlQueryError(exc.read().decode(errors="replace").strip()) from exc
