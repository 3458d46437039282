"""Where the tables live, and one clickhouse-connect client to reach them.

Embedded (default): chDB in this process through clickhouse-connect's chdb backend,
persistent in ``TRAINMON_CLICKHOUSE_PATH`` (default ``./trainmon-data/chdb``, relative
to the working directory). Production: a ClickHouse server at ``TRAINMON_CLICKHOUSE_URL``
with ``TRAINMON_CLICKHOUSE_USER`` / ``_PASSWORD``. Both use the database
``TRAINMON_CLICKHOUSE_DATABASE`` (default ``trainmon``) and exactly the same SQL.

chDB hosts one engine per process and locks its data directory against other
processes; see :mod:`.sql_endpoint` for how ``trainmon sql`` reaches a directory that
a running service holds.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

DEFAULT_PATH = Path("trainmon-data") / "chdb"
DEFAULT_DATABASE = "trainmon"
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Target:
    """One ClickHouse destination: a server ``url`` or else an embedded chDB ``path``."""

    path: Path = DEFAULT_PATH
    url: str | None = None
    user: str | None = None
    password: str | None = None
    database: str = DEFAULT_DATABASE

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if not _IDENTIFIER.match(self.database):
            raise ValueError(f"TRAINMON_CLICKHOUSE_DATABASE: {self.database!r} is not a plain "
                             "identifier (letters, digits, underscore)")

    @property
    def embedded(self) -> bool:
        return self.url is None

    @classmethod
    def from_env(cls, env: dict | None = None, **overrides) -> "Target":
        env = os.environ if env is None else env
        target = cls(
            path=Path(env.get("TRAINMON_CLICKHOUSE_PATH") or DEFAULT_PATH),
            url=env.get("TRAINMON_CLICKHOUSE_URL") or None,
            user=env.get("TRAINMON_CLICKHOUSE_USER") or None,
            password=env.get("TRAINMON_CLICKHOUSE_PASSWORD") or None,
            database=env.get("TRAINMON_CLICKHOUSE_DATABASE") or DEFAULT_DATABASE,
        )
        return replace(target, **{k: v for k, v in overrides.items() if v is not None})

    def describe(self) -> str:
        return f"{self.url}/{self.database}" if self.url else f"chdb:{self.path.resolve()}/{self.database}"


class EngineBusy(RuntimeError):
    """The embedded data directory cannot be opened by this process right now."""


class DirectoryLocked(EngineBusy):
    """Another process holds the embedded data directory; it may let go soon."""


def connect(target: Target | None = None):
    """A clickhouse-connect client on ``target`` (from env when not given).

    The client's default database is left alone: all trainmon SQL names its tables as
    ``<database>.<table>``, and the database may not exist before ``create_all``.
    """
    import clickhouse_connect

    from clickhouse_connect.driver.exceptions import ProgrammingError

    target = target or Target.from_env()
    if target.embedded:
        target.path.mkdir(parents=True, exist_ok=True)
        try:
            # Load every table and view before the first query: with chDB's default
            # asynchronous loading, an insert right after start could run before a
            # user's materialized view on that table is attached, and skip it.
            return clickhouse_connect.get_client(interface="chdb", path=str(target.path),
                                                 chdb_options={"async_load_databases": "0"})
        except ProgrammingError as exc:
            text = str(exc)
            if "already initialized with path" in text:
                raise EngineBusy(f"this process already has another chDB directory open ({text}); "
                                 "close that client first") from exc
            if "Cannot lock file" in text or "Error initializing EmbeddedServer" in text:
                raise DirectoryLocked(f"{target.path} is in use by another process (a running "
                                      "'trainmon consume clickhouse' or 'trainmon replay'?)") from exc
            raise
    kwargs = {"dsn": target.url}
    if target.user:
        kwargs["username"] = target.user
    if target.password:
        kwargs["password"] = target.password
    return clickhouse_connect.get_client(**kwargs)


def connect_when_free(target: Target, wait_s: float = 30.0, poll_s: float = 0.5):
    """``connect``, waiting up to ``wait_s`` for another process to let go of an embedded
    directory: a ``trainmon sql`` run holds it for the length of its query, and a service
    started at that moment should start, not exit."""
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            return connect(target)
        except DirectoryLocked as exc:
            if time.monotonic() >= deadline:
                raise
            if not waiting:
                logging.getLogger("trainmon.clickhouse").info("%s; waiting up to %.0f s", exc, wait_s)
                waiting = True
            time.sleep(poll_s)
