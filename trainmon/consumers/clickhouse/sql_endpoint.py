"""ClickHouse's HTTP interface on the embedded engine, for other processes and clients.

chDB runs inside one process and locks its data directory, so while ``trainmon consume
clickhouse`` (or ``trainmon replay``) runs on a path, no other process can open that
path. The service therefore answers SQL over HTTP the way a ClickHouse server does, so
that ``trainmon sql``, clickhouse-connect, clickhouse-go (Grafana's ClickHouse data
source), DBeaver or curl can read the tables while it loads them:

* the query in the body and/or ``?query=``; ``database=``, ``default_format=``,
  ``param_<name>=`` query parameters, and every other URL parameter a setting;
* ``GET /ping`` and ``GET /`` answer ``Ok.``; a query sent with GET runs with
  ``readonly=2`` as on a server;
* users: HTTP basic auth, ``X-ClickHouse-User`` / ``X-ClickHouse-Key`` or ``user=`` /
  ``password=``; ``trainmon`` (the services' own) and ``viewer`` (``readonly=1``: no
  INSERT, DDL or settings changes; ``max_execution_time`` is changeable in readonly
  mode, as clickhouse-go sets it on every query). Passwords are made at first start and
  kept in ``<data dir>/sql-users.json`` (mode 0600);
* every output format chDB renders (Native with ``client_protocol_version``'s block
  info, RowBinary, JSON, Parquet...); ``compress=1`` / ``decompress=1`` (ClickHouse's
  checksummed LZ4 / ZSTD blocks) and, with ``enable_http_compression=1``, the
  ``Accept-Encoding`` / ``Content-Encoding`` ones (gzip, deflate, zstd, lz4, xz, bz2);
* errors as a server returns them: the status code ClickHouse maps the error to,
  ``X-ClickHouse-Exception-Code`` and the ``Code: N. DB::Exception: ...`` text.

It listens on 127.0.0.1 unless told otherwise (``--listen``); beyond loopback it
requires TLS (``--tls-cert`` / ``--tls-key``). The URL and the users are written to
``<data dir>/sql-endpoint.json`` (mode 0600) and the file is removed at shutdown.
``trainmon sql`` uses the file when its process is alive, and otherwise opens the
directory itself; ``trainmon grafana provision`` reads it for the data source.
"""

from __future__ import annotations

import base64
import bz2
import gzip
import ipaddress
import json
import logging
import lzma
import os
import re
import secrets
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from clickhouse_connect.driver.exceptions import Error as ClickHouseError

from .native_wire import CompressedDataError, compress_blocks, decompress_blocks, native_for_revision

log = logging.getLogger("trainmon.clickhouse")
ENDPOINT_FILE = "sql-endpoint.json"
USERS_FILE = "sql-users.json"
SERVICE_USER = "trainmon"
VIEWER_USER = "viewer"
DEFAULT_LISTEN = "127.0.0.1"
# ClickHouse's settings constraint changeable_in_readonly, for the viewer: clickhouse-go
# sends max_execution_time with every query (Grafana's data source docs ask for this).
CHANGEABLE_IN_READONLY = ("max_execution_time",)
# URL parameters the HTTP layer consumes: not settings of the query.
TRANSPORT_PARAMS = frozenset({
    "query", "database", "default_format", "user", "password", "quota_key", "query_id",
    "session_id", "session_timeout", "session_check", "compress", "decompress", "buffer_size",
    "wait_end_of_query", "client_protocol_version", "enable_http_compression",
    "send_progress_in_http_headers", "http_headers_progress_interval_ms", "role", "stacktrace",
    "cancel_http_readonly_queries_on_client_close", "http_zlib_compression_level",
    "network_compression_method", "network_zstd_compression_level",
    "http_native_compression_disable_checksumming_on_decompress",
})
_TRAILING_FORMAT = re.compile(r"\bFORMAT\s+(\w+)\s*;?\s*$", re.IGNORECASE)
_CODE = re.compile(r"Code: (\d+)\.")
_NAME = re.compile(r"\(([A-Z][A-Z0-9_]+)\)(?: \(version [^)]*\))?\.?\s*$")

# ClickHouse's exceptionCodeToHTTPStatus, by error name.
_STATUS_BY_NAME = {
    "REQUIRED_PASSWORD": 401,
    **dict.fromkeys(("UNKNOWN_USER", "WRONG_PASSWORD", "AUTHENTICATION_FAILED",
                     "SET_NON_GRANTED_ROLE"), 403),
    **dict.fromkeys((
        "BAD_ARGUMENTS", "CANNOT_COMPILE_REGEXP", "CANNOT_PARSE_TEXT", "CANNOT_PARSE_ESCAPE_SEQUENCE",
        "CANNOT_PARSE_QUOTED_STRING", "CANNOT_PARSE_DATE", "CANNOT_PARSE_DATETIME",
        "CANNOT_PARSE_NUMBER", "CANNOT_PARSE_DOMAIN_VALUE_FROM_STRING", "CANNOT_PARSE_IPV4",
        "CANNOT_PARSE_IPV6", "CANNOT_PARSE_INPUT_ASSERTION_FAILED", "CANNOT_PARSE_UUID",
        "DUPLICATE_COLUMN", "ILLEGAL_COLUMN", "UNKNOWN_ELEMENT_IN_AST", "UNKNOWN_TYPE_OF_AST_NODE",
        "THERE_IS_NO_COLUMN", "TOO_DEEP_AST", "TOO_BIG_AST", "UNEXPECTED_AST_STRUCTURE",
        "SYNTAX_ERROR", "INCORRECT_DATA", "TYPE_MISMATCH", "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE"), 400),
    **dict.fromkeys((
        "UNKNOWN_TABLE", "UNKNOWN_FUNCTION", "UNKNOWN_IDENTIFIER", "UNKNOWN_TYPE", "UNKNOWN_STORAGE",
        "UNKNOWN_DATABASE", "UNKNOWN_SETTING", "UNKNOWN_DIRECTION_OF_SORTING",
        "UNKNOWN_AGGREGATE_FUNCTION", "UNKNOWN_FORMAT", "UNKNOWN_DATABASE_ENGINE",
        "UNKNOWN_TYPE_OF_QUERY", "UNKNOWN_ROLE"), 404),
    "QUERY_IS_TOO_LARGE": 413,
    "NOT_IMPLEMENTED": 501,
    "SOCKET_TIMEOUT": 503,
    "CANNOT_OPEN_FILE": 503,
    "HTTP_LENGTH_REQUIRED": 411,
    "TIMEOUT_EXCEEDED": 408,
    "CANNOT_SCHEDULE_TASK": 503,
}
# Codes this module raises itself (the rest come from chDB with their names).
_CODES = {"SYNTAX_ERROR": 62, "REQUIRED_PASSWORD": 194, "AUTHENTICATION_FAILED": 516,
          "CANNOT_DECOMPRESS": 271, "CHECKSUM_DOESNT_MATCH": 40, "UNKNOWN_FORMAT": 73,
          "READONLY": 164, "INTO_OUTFILE_NOT_ALLOWED": 358, "STD_EXCEPTION": 1001}

_CONTENT_TYPES = {
    "TabSeparated": "text/tab-separated-values", "TSV": "text/tab-separated-values",
    "CSV": "text/csv", "CSVWithNames": "text/csv", "CSVWithNamesAndTypes": "text/csv",
    "JSON": "application/json", "JSONCompact": "application/json",
    "JSONEachRow": "application/x-ndjson", "JSONCompactEachRow": "application/x-ndjson",
    "JSONStrings": "application/json", "JSONCompactStrings": "application/json",
    "XML": "application/xml", "Markdown": "text/markdown",
}
_BINARY_FORMATS = ("Native", "RowBinary", "Parquet", "Arrow", "ORC", "Avro", "Protobuf",
                   "MsgPack", "CapnProto", "BSONEachRow", "Npy")


class SqlQueryError(RuntimeError):
    """ClickHouse refused the query; the message is ClickHouse's."""


def run_sql(client, sql: str, fmt: str, settings: dict | None = None) -> bytes:
    """The one way trainmon runs a person's SQL: ClickHouse renders the format."""
    try:
        return client.raw_query(sql, fmt=fmt, settings=settings)
    except ClickHouseError as exc:
        raise SqlQueryError(str(exc).strip()) from exc


# -- users -------------------------------------------------------------------------------


@dataclass(frozen=True)
class User:
    name: str
    password: str
    readonly: int = 0


def load_users(data_dir: Path) -> dict[str, User]:
    """The endpoint's users, made with random passwords at first start and kept in
    ``<data dir>/sql-users.json`` (0600), so a provisioned Grafana keeps working across
    restarts."""
    path = Path(data_dir) / USERS_FILE
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    wanted = {SERVICE_USER: 0, VIEWER_USER: 1}
    changed = False
    for name, readonly in wanted.items():
        entry = stored.get(name)
        if not isinstance(entry, dict) or not entry.get("password"):
            stored[name] = {"password": secrets.token_urlsafe(18), "readonly": readonly}
            changed = True
    if changed:
        _write_private(path, stored)
    return {name: User(name, str(entry["password"]), int(entry.get("readonly", 0)))
            for name, entry in stored.items() if isinstance(entry, dict) and entry.get("password")}


def _write_private(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


# -- where to listen ---------------------------------------------------------------------


def parse_listen(listen: str | None) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` -> (host, port); port 0: any free."""
    listen = (listen or DEFAULT_LISTEN).strip()
    if listen.startswith("["):
        host, _, rest = listen[1:].partition("]")
        return host, int(rest.lstrip(":") or 0)
    if listen.count(":") == 1:
        host, port = listen.split(":")
        return host or DEFAULT_LISTEN, int(port or 0)
    return listen, 0  # a bare host, or a bare IPv6 address


def is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                               for info in infos)


def listen_problem(listen: str | None, tls_cert=None, tls_key=None) -> str | None:
    """Why the endpoint cannot listen there as asked, or None."""
    try:
        host, _ = parse_listen(listen)
    except ValueError:
        return f"--listen {listen!r}: give HOST or HOST:PORT"
    if bool(tls_cert) != bool(tls_key):
        return "TLS needs both a certificate (--tls-cert) and its key (--tls-key)"
    if tls_cert and not (Path(tls_cert).is_file() and Path(tls_key).is_file()):
        return f"--tls-cert {tls_cert} or --tls-key {tls_key} is not a readable file"
    if not tls_cert and not is_loopback(host):
        return (f"the SQL endpoint would listen on {host}, beyond loopback: give it a TLS "
                "certificate and key (--tls-cert, --tls-key), or listen on 127.0.0.1")
    return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def get_request(self):
        sock, addr = self.socket.accept()
        if self.tls is not None:  # the handshake runs in the request's thread
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr


class _Server6(_Server):
    address_family = socket.AF_INET6


class ClickHouseHttpError(Exception):
    def __init__(self, name: str, message: str, code: int | None = None):
        self.code = code if code is not None else _CODES.get(name, 1001)
        self.name = name
        text = message if message.startswith("Code: ") else \
            f"Code: {self.code}. DB::Exception: {message}. ({name})"
        super().__init__(text)


def _error_of(exc: Exception) -> tuple[int, str]:
    """(code, text) of a chDB error, ClickHouse's text as is."""
    text = str(exc).strip()
    at = text.find("Code: ")
    if at > 0:
        text = text[at:]
    match = _CODE.match(text)
    if match:
        return int(match.group(1)), text
    return 1001, f"Code: 1001. DB::Exception: {text or type(exc).__name__}. (STD_EXCEPTION)"


def _status_of(text: str) -> int:
    match = _NAME.search(text)
    return _STATUS_BY_NAME.get(match.group(1), 500) if match else 500


_READS = re.compile(r"^\s*(?:--[^\n]*\n\s*|/\*.*?\*/\s*)*(SELECT|WITH|SHOW|DESCRIBE|DESC|EXPLAIN|EXISTS)\b",
                    re.IGNORECASE | re.DOTALL)


# What ClickHouse's lexer skips: comments (/* */ nest) and what is quoted.
_SKIPPED = re.compile(r"--|#|/\*|['\"`]")
_COMMENT_MARK = re.compile(r"/\*|\*/")
_QUOTED_REST = {q: re.compile(r"(?:[^%s\\]|\\.|%s%s)*%s" % (q, q, q, q), re.DOTALL) for q in "'\"`"}
_INSERT = re.compile(r"^\s*INSERT\b", re.IGNORECASE)
_INTO_OUTFILE = re.compile(r"\bINTO\s+OUTFILE\b", re.IGNORECASE)
_KILL = re.compile(r"^\s*KILL\b", re.IGNORECASE)


def _words(sql: str) -> str:
    """``sql`` with its comments, string literals and quoted identifiers blanked out."""
    out, pos, end = [], 0, len(sql)
    while True:
        mark = _SKIPPED.search(sql, pos)
        if mark is None:
            out.append(sql[pos:])
            return "".join(out)
        out.append(sql[pos:mark.start()] + " ")
        token, pos = mark.group(), mark.end()
        if token in ("--", "#"):
            newline = sql.find("\n", pos)
            pos = end if newline < 0 else newline
        elif token == "/*":
            depth = 1
            while depth:
                inner = _COMMENT_MARK.search(sql, pos)
                if inner is None:
                    return "".join(out)  # unterminated: ClickHouse refuses it
                depth += 1 if inner.group() == "/*" else -1
                pos = inner.end()
        else:
            rest = _QUOTED_REST[token].match(sql, pos)
            if rest is None:
                return "".join(out)  # unterminated
            pos = rest.end()


def _refuse_what_a_server_refuses(sql: str, user: "User", readonly: bool) -> None:
    """chDB is clickhouse-local: it writes INTO OUTFILE on this host, which a server refuses
    over HTTP; and it runs every query as one user, so a readonly user's KILL QUERY would
    cancel the other users' queries and the loader's inserts (a server's readonly user
    without the KILL QUERY grant cannot). An INSERT's data is not looked at."""
    head = _words(sql[:65536])
    if _INSERT.match(head):
        return
    words = head if len(sql) <= 65536 else _words(sql)
    if _INTO_OUTFILE.search(words):
        raise ClickHouseHttpError("INTO_OUTFILE_NOT_ALLOWED", "INTO OUTFILE is not allowed")
    if readonly and _KILL.match(words):
        raise ClickHouseHttpError("READONLY", f"{user.name}: Cannot execute query in readonly mode")


def _native_header(run, sql: str, query_params: dict) -> bytes:
    """The header block a server sends for a result without rows, where chDB's Native
    sends nothing: names and types from the same query in JSON (only for reads, which
    can run twice)."""
    from .native_wire import leb128

    meta = json.loads(bytes(run(sql, "JSON", params=query_params).bytes() or b"{}") or b"{}").get("meta") or []
    if not meta:
        return b""
    out = bytearray(leb128(len(meta)) + leb128(0))
    for column in meta:
        for text in (column["name"], column["type"]):
            raw = text.encode()
            out += leb128(len(raw)) + raw
    return bytes(out)


def _quote_value(value: str) -> str:
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _content_encoder(accept: str):
    """The first encoding of Accept-Encoding that we can write: (name, encode)."""
    encoders = {
        "gzip": lambda b: gzip.compress(b, 3),
        "deflate": lambda b: zlib.compress(b, 3),
        "xz": lzma.compress,
        "bz2": bz2.compress,
    }
    try:
        import lz4.frame

        encoders["lz4"] = lz4.frame.compress
    except ImportError:
        pass
    try:
        from clickhouse_connect.driver.compression import _require_zstd

        encoders["zstd"] = _require_zstd().compress
    except Exception:  # noqa: BLE001 - zstd absent: not offered
        pass
    for item in accept.split(","):
        name = item.split(";")[0].strip().lower()
        if name in encoders:
            return name, encoders[name]
    return None, None


def _content_decode(body: bytes, encoding: str) -> bytes:
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding in ("gzip", "x-gzip"):
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    if encoding == "xz":
        return lzma.decompress(body)
    if encoding == "bz2":
        return bz2.decompress(body)
    if encoding == "lz4":
        import lz4.frame

        return lz4.frame.decompress(body)
    if encoding == "zstd":
        from clickhouse_connect.driver.compression import _require_zstd

        return _require_zstd().decompress(body)
    if encoding == "br":
        try:
            import brotli
        except ImportError:
            raise ClickHouseHttpError("CANNOT_DECOMPRESS", "Content-Encoding br is not supported here")
        return brotli.decompress(body)
    raise ClickHouseHttpError("CANNOT_DECOMPRESS", f"Unknown Content-Encoding of HTTP request: {encoding}")


# -- the endpoint ------------------------------------------------------------------------


class SqlEndpoint:
    """ClickHouse's HTTP interface for the chDB engine of this process, on ``data_dir``."""

    def __init__(self, client, data_dir: Path, listen: str | None = None, database: str | None = None,
                 tls_cert: str | os.PathLike | None = None, tls_key: str | os.PathLike | None = None):
        self.client = client
        self.data_dir = Path(data_dir)
        self.file = self.data_dir / ENDPOINT_FILE
        self.database = database or getattr(client, "database", None) or "default"
        self.users = load_users(self.data_dir)
        self._conn_str = f"{os.path.realpath(self.data_dir)}?async_load_databases=0"
        problem = listen_problem(listen, tls_cert, tls_key)
        if problem:
            raise ValueError(problem)
        host, port = parse_listen(listen)
        self.tls_cert = str(tls_cert) if tls_cert else None
        server_class = _Server6 if ":" in host else _Server
        self._server = server_class((host, port), self._handler())
        if tls_cert:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls_cert), str(tls_key))
            self._server.tls = context
        self._thread = threading.Thread(target=self._server.serve_forever, name="sql-endpoint",
                                        daemon=True)
        self._server_info = self._probe()

    def _probe(self) -> dict:
        conn = self._connect()
        try:
            version, tz = bytes(conn.query("SELECT version(), timezone()", "TabSeparated").bytes()) \
                .decode().strip().split("\t")
        finally:
            conn.close()
        return {"version": version, "timezone": tz, "display_name": socket.gethostname()}

    def _connect(self):
        import chdb

        return chdb.connect(self._conn_str)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1" if host == "0.0.0.0" else "::1"
        if ":" in host:
            host = f"[{host}]"
        scheme = "https" if self._server.tls is not None else "http"
        return f"{scheme}://{host}:{port}/"

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def info(self) -> dict:
        service, viewer = self.users[SERVICE_USER], self.users[VIEWER_USER]
        info = {"url": self.url, "pid": os.getpid(), "database": self.database,
                "listen": self._server.server_address[0], "port": self.port,
                "user": service.name, "password": service.password,
                "viewer": viewer.name, "viewer_password": viewer.password}
        if self.tls_cert:
            info["tls_cert"] = str(Path(self.tls_cert).resolve())
        return info

    def start(self) -> "SqlEndpoint":
        self._thread.start()
        _write_private(self.file, self.info())
        log.info("answering SQL (ClickHouse HTTP interface) on %s", self.url)
        return self

    def stop(self) -> None:
        try:
            if json.loads(self.file.read_text()).get("pid") == os.getpid():
                self.file.unlink()
        except (OSError, ValueError):
            pass
        self._server.shutdown()
        self._server.server_close()

    # -- one request ---------------------------------------------------------------------

    def authenticate(self, headers, params: dict) -> User:
        header_user = headers.get("X-ClickHouse-User")
        authorization = headers.get("Authorization") or ""
        basic = authorization[6:] if authorization[:6].lower() == "basic " else None
        if header_user is not None:
            if basic is not None or "user" in params or "password" in params:
                raise ClickHouseHttpError(
                    "REQUIRED_PASSWORD", "Invalid authentication: it is not allowed to use "
                    "X-ClickHouse HTTP headers and other authentication methods simultaneously")
            name, password = header_user, headers.get("X-ClickHouse-Key") or ""
        elif basic is not None:
            try:
                name, _, password = base64.b64decode(basic).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                name, password = "", ""
        else:
            name, password = params.get("user", "default"), params.get("password", "")
        user = self.users.get(name)
        if user is None or not secrets.compare_digest(password.encode(), user.password.encode()):
            raise ClickHouseHttpError("AUTHENTICATION_FAILED", f"{name}: Authentication failed: "
                                      "password is incorrect, or there is no user with such name")
        return user

    def execute(self, user: User, sql: str, params: dict, method: str) -> tuple[bytes, str, dict]:
        """Run ``sql`` for ``user``; (body, format, summary). Raises ClickHouseHttpError."""
        if not sql.strip():
            raise ClickHouseHttpError("SYNTAX_ERROR", "Empty query")
        default_format = params.get("default_format") or "TabSeparated"
        query_params = {k[6:]: v for k, v in params.items() if k.startswith("param_")}
        settings = {k: v for k, v in params.items()
                    if k not in TRANSPORT_PARAMS and not k.startswith("param_")}
        for name in settings:
            if not _SETTING_NAME.match(name):
                raise ClickHouseHttpError("UNKNOWN_SETTING", f"Unknown setting '{name}'", code=115)
        database = params.get("database") or self.database
        _refuse_what_a_server_refuses(sql, user, bool(user.readonly) or method == "GET")
        conn = self._connect()
        try:
            def run(statement: str, fmt: str = "TabSeparated", **kw):
                try:
                    # The exact bytes: an INSERT's data (Native, RowBinary...) is not text.
                    return conn.query(statement.encode("utf-8", "surrogateescape"), fmt, **kw)
                except Exception as exc:  # chDB's error: ClickHouse's code and text
                    code, text = _error_of(exc)
                    # chDB runs every query as its one user, "default": name ours.
                    text = text.replace("DB::Exception: default: ", f"DB::Exception: {user.name}: ", 1)
                    raise ClickHouseHttpError("", text, code=code) from exc

            run(f"USE `{database.replace('`', '``')}`")
            # A session's settings, in the order a server applies them: the user's profile
            # (readonly, with its changeable_in_readonly constraints), GET's readonly=2,
            # then the request's, which readonly mode refuses to change.
            early = {k: settings.pop(k) for k in CHANGEABLE_IN_READONLY if k in settings}
            for name, value in early.items():
                run(f"SET {name} = {_quote_value(value)}")
            if user.readonly:
                run(f"SET readonly = {int(user.readonly)}")
            elif method == "GET":
                run("SET readonly = 2")
            for name, value in settings.items():
                run(f"SET {name} = {_quote_value(value)}")
            result = run(sql, default_format, params=query_params)
            body = bytes(result.bytes() or b"")
            match = _TRAILING_FORMAT.search(sql)
            fmt = match.group(1) if match else default_format
            if fmt.lower() == "native" and not body and _READS.match(sql):
                body = _native_header(run, sql[:match.start()] if match else sql, query_params)
            summary = {"read_rows": str(result.rows_read()), "read_bytes": str(result.bytes_read()),
                       "written_rows": str(getattr(result, "rows_written", lambda: 0)()),
                       "written_bytes": str(getattr(result, "bytes_written", lambda: 0)()),
                       "elapsed_ns": str(int(result.elapsed() * 1e9))}
        finally:
            conn.close()
        if fmt.lower() == "native":
            try:
                revision = int(params.get("client_protocol_version") or 0)
            except ValueError:
                revision = 0
            body = native_for_revision(body, revision)
        return body, fmt, summary

    def _handler(self):
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as clients pool connections
            # TCP_NODELAY: the headers and the body go out as two writes, and on a kept-alive
            # connection Nagle held the body until the client's delayed ACK of the headers:
            # 40 ms more on every answer (541 panel queries: 57 ms each, 30 s, measured).
            disable_nagle_algorithm = True
            server_version = "trainmon-chdb"
            sys_version = ""

            def setup(self):
                super().setup()
                if isinstance(self.connection, ssl.SSLSocket):
                    self.connection.settimeout(30)
                    self.connection.do_handshake()
                    self.connection.settimeout(None)

            def handle_one_request(self):
                try:
                    super().handle_one_request()
                except (ssl.SSLError, ConnectionError, TimeoutError):
                    self.close_connection = True

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _serve(self, method: str):
                url = urllib.parse.urlsplit(self.path)
                params = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
                body = self._read_body() if method == "POST" else b""
                path = url.path.rstrip("/") or "/"
                if path == "/ping" or (path == "/" and method == "GET" and "query" not in params):
                    return self._reply(200, b"Ok.\n", {"Content-Type": "text/html; charset=UTF-8"})
                if path != "/":
                    return self._reply(404, f"There is no handle {url.path}\n".encode(),
                                       {"Content-Type": "text/plain; charset=UTF-8"})
                headers = {"X-ClickHouse-Timezone": endpoint._server_info["timezone"],
                           "X-ClickHouse-Server-Display-Name": endpoint._server_info["display_name"]}
                compress = params.get("compress") == "1"
                encoding, encode = (None, None)
                if params.get("enable_http_compression") == "1":
                    encoding, encode = _content_encoder(self.headers.get("Accept-Encoding") or "")
                # ClickHouse takes these as headers too.
                for header, param in (("X-ClickHouse-Database", "database"),
                                      ("X-ClickHouse-Format", "default_format")):
                    if self.headers.get(header) and param not in params:
                        params[param] = self.headers[header]
                headers["X-ClickHouse-Query-Id"] = params.get("query_id") or str(uuid.uuid4())
                try:
                    user = endpoint.authenticate(self.headers, params)
                    try:
                        body = _content_decode(body, self.headers.get("Content-Encoding") or "")
                        if params.get("decompress") == "1" and body:
                            body = decompress_blocks(body)
                    except CompressedDataError as exc:
                        raise ClickHouseHttpError("CHECKSUM_DOESNT_MATCH" if "checksum" in str(exc)
                                                  else "CANNOT_DECOMPRESS", str(exc)) from exc
                    except ClickHouseHttpError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - a body that does not decode
                        raise ClickHouseHttpError("CANNOT_DECOMPRESS", f"Cannot decompress the "
                                                  f"request body: {exc}") from exc
                    sql = params.get("query", "")
                    if body:
                        # surrogateescape: execute gives chDB these bytes back unchanged.
                        text = body.decode("utf-8", "surrogateescape")
                        sql = f"{sql}\n{text}" if sql else text
                    started = time.monotonic()
                    try:
                        out, fmt, summary = endpoint.execute(user, sql, params, method)
                    except ClickHouseHttpError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - an answer, not a dropped connection
                        log.warning("query failed in the endpoint: %s", exc, exc_info=True)
                        raise ClickHouseHttpError("STD_EXCEPTION", f"{type(exc).__name__}: {exc}") from exc
                    log.debug("%s ran a query in %.3f s", user.name, time.monotonic() - started)
                except ClickHouseHttpError as exc:
                    text = str(exc).rstrip() + "\n"
                    status = _STATUS_BY_NAME.get(exc.name, 500) if exc.name else _status_of(text)
                    headers.update({"X-ClickHouse-Exception-Code": str(exc.code),
                                    "Content-Type": "text/plain; charset=UTF-8"})
                    if status == 401:
                        headers["WWW-Authenticate"] = 'Basic realm="ClickHouse server HTTP API"'
                    payload = text.encode()
                    if compress:
                        payload = compress_blocks(payload, params.get("network_compression_method", "LZ4"))
                    elif encode is not None:
                        payload = encode(payload)
                        headers["Content-Encoding"] = encoding
                    return self._reply(status, payload, headers)
                base = fmt.removesuffix("WithNamesAndTypes").removesuffix("WithNames")
                if fmt in _CONTENT_TYPES or base in _CONTENT_TYPES:
                    content_type = _CONTENT_TYPES.get(fmt) or _CONTENT_TYPES[base]
                    content_type += "; charset=UTF-8"
                elif base.startswith(_BINARY_FORMATS):
                    content_type = "application/octet-stream"
                else:
                    content_type = "text/plain; charset=UTF-8"
                headers.update({"Content-Type": content_type, "X-ClickHouse-Format": fmt,
                                "X-ClickHouse-Summary": json.dumps(summary, separators=(",", ":"))})
                if compress:
                    level = params.get("network_zstd_compression_level")
                    out = compress_blocks(out, params.get("network_compression_method", "LZ4"),
                                          int(level) if level and level.isdigit() else None)
                elif encode is not None:
                    out = encode(out)
                    headers["Content-Encoding"] = encoding
                self._reply(200, out, headers)

            def _reply(self, status: int, body: bytes, headers: dict):
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        return Handler


# -- the client side: trainmon sql -------------------------------------------------------


def find_endpoint(data_dir: Path) -> dict | None:
    """The running service's endpoint for ``data_dir``, or None when there is none."""
    try:
        info = json.loads((Path(data_dir) / ENDPOINT_FILE).read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no file, or its process is gone (e.g. killed with -9)
    return info


def _tls_context(info: dict) -> ssl.SSLContext | None:
    if not info.get("url", "").startswith("https:"):
        return None
    context = ssl.create_default_context(cafile=info.get("tls_cert"))
    context.check_hostname = False  # the URL names our own process, found through a 0600 file
    return context


def query_endpoint(info: dict, sql: str, fmt: str, settings: dict | None = None,
                   timeout: float = 300.0) -> bytes:
    """Run SQL on a service's endpoint as its service user; URLError when it does not answer."""
    params = {"default_format": fmt, **(settings or {})}
    if info.get("database"):
        params.setdefault("database", info["database"])
    url = info["url"] + "?" + urllib.parse.urlencode(params)
    credentials = base64.b64encode(f"{info['user']}:{info['password']}".encode()).decode()
    request = urllib.request.Request(url, data=sql.encode(), method="POST",
                                     headers={"Authorization": f"Basic {credentials}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=_tls_context(info)) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        raise SqlQueryError(exc.read().decode(errors="replace").strip()) from exc
