"""Creates and migrates the database: the one module that runs DDL against a client.

The statements come from the pure modules below it: :mod:`.ddl` (record tables),
:mod:`.rollups` (pre-aggregated tables and their materialized views), :mod:`.views`
(plain views); :mod:`.settings` gives every table its settings.
"""

from __future__ import annotations

import re

from ...schemas import RECORD_TYPES
from .ddl import create_table_sql, derived_default, nullable_of, table_fields
from .rollups import PROBES, rollups
from .settings import settings_sql
from .goodput import REFRESHED
from .views import VIEWS


def create_all(client, database: str = "trainmon") -> None:
    """Create (or migrate) the database, one table per record kind, the rollups
    (pre-aggregated tables the dashboards read, see :mod:`.rollups`) and the views.

    Safe to call at every start: existing tables only gain missing columns (and Nullable
    where a field became optional) and this version's TABLE_SETTINGS, and the views are
    replaced (``CREATE OR REPLACE``), so a view that gained a column has it after the next
    start.
    """
    client.command(f"CREATE DATABASE IF NOT EXISTS {database}")
    for kind in RECORD_TYPES:
        client.command(create_table_sql(kind, database))
        apply_table_settings(client, f"{database}.{kind}")
        migrate_table(client, kind, database)
    create_rollups(client, database)
    create_views(client, database)


def apply_table_settings(client, table: str) -> None:
    """Give a table made by an older version the settings of a new one."""
    client.command(f"ALTER TABLE {table} MODIFY SETTING {settings_sql()}")


def migrate_table(client, kind: str, database: str) -> list[str]:
    """Add columns for schema fields the table lacks, make a column Nullable whose field
    became optional (e.g. ``step.norm``), and give a derived field's column its DEFAULT
    (``step.tokens_per_second``); returns the fields added or changed.

    Otherwise a field whose type changed, or that was removed, keeps its old column
    (ClickHouse cannot rewrite a column's type in place cheaply). Widening to Nullable is
    the one retyping done: old rows keep their values, and without it a record lacking
    the field could not be inserted at all.
    """
    columns = table_columns(client, database, kind)
    have = {name: ch_type for name, ch_type, _ in columns}
    defaults = {name: default for name, _, default in columns}
    model = RECORD_TYPES[kind]
    changed = []
    for f in table_fields(model):
        if not any(c.name in have for c in f.columns):
            client.command(f"ALTER TABLE {database}.{kind} ADD COLUMN IF NOT EXISTS {f.definition}")
            changed.append(f.field)
            continue
        old = have.get(f.field) if len(f.columns) == 1 else None
        derived = derived_default(model, f.field)
        if old is not None and old != f.columns[0].type and nullable_of(old) == f.columns[0].type:
            drop_views(client, database)  # a column a view reads cannot be retyped; recreated next
            client.command(f"ALTER TABLE {database}.{kind} MODIFY COLUMN {f.definition}")
            changed.append(f.field)
        elif derived and not defaults.get(f.field):
            # A derived field's column made before records left it out: computed from now on
            # when a record does (the rows already there hold it).
            client.command(f"ALTER TABLE {database}.{kind} MODIFY COLUMN `{f.field}`{derived}")
            changed.append(f.field)
    return changed


def create_rollups(client, database: str) -> list[str]:
    """Create the rollup tables and their views; a table created now is filled from the
    rows already in its record table (once: the view feeds it from then on). Returns the
    names of the tables created. Run before the loader starts inserting (as the services
    do), or rows inserted between the view's creation and the backfill count twice."""
    created = []
    for name, (table, view, backfill) in rollups(database).items():
        key = _sorting_key(client, database, name)
        existed = key is not None
        if existed and (name in PROBES and not _readable(client, PROBES[name].format(db=database))
                        or key != _order_by(table)):
            # made by an older version, with columns this one cannot read or in another
            # order (rank_10s was time first): made again
            client.command(f"DROP VIEW IF EXISTS {database}.{name}_mv")
            client.command(f"DROP TABLE IF EXISTS {database}.{name}")
            existed = False
        client.command(table)
        apply_table_settings(client, f"{database}.{name}")
        client.command(view)
        if not existed:
            client.command(backfill)
            created.append(name)
    return created


def _sorting_key(client, database: str, name: str) -> str | None:
    """The table's key as system.tables spells it; None where there is no such table."""
    rows = client.query("SELECT sorting_key FROM system.tables WHERE database = {db:String} AND name = {t:String}",
                        parameters={"db": database, "t": name}).result_rows
    return rows[0][0] if rows else None


def _order_by(create_table: str) -> str:
    """The key of a CREATE TABLE statement, as system.tables spells it ("a, b")."""
    return re.search(r"^ORDER BY \((.*)\)$", create_table, re.MULTILINE).group(1)


def _readable(client, probe: str) -> bool:
    try:
        client.query(probe)
    except Exception:  # noqa: BLE001 - the server's refusal: the columns are not this version's
        return False
    return True


def drop_views(client, database: str) -> None:
    """Detach the rollups from the record tables (to retype a column they read);
    :func:`create_rollups` attaches them again."""
    for name in rollups(database):
        client.command(f"DROP VIEW IF EXISTS {database}.{name}_mv")


def create_views(client, database: str) -> None:
    for sql in VIEWS.values():
        client.command(sql.format(db=database))


def refresh_now(client, database: str = "trainmon") -> None:
    """Run the refreshed views now and wait for them (they run on ClickHouse's schedule
    otherwise): after loading records a reader wants in them at once."""
    for name in REFRESHED:
        client.command(f"SYSTEM REFRESH VIEW {database}.{name}")
        client.command(f"SYSTEM WAIT VIEW {database}.{name}")


def create_probe_table(client, kind: str, database: str) -> str:
    """A Null-engine twin of a kind's table (stores nothing): inserting a record there
    tells whether ClickHouse can take it without writing it. Returns its name."""
    name = f"{database}._probe_{kind}"
    client.command(f"DROP TABLE IF EXISTS {name}")  # fresh, in case the table was migrated
    client.command(f"CREATE TABLE {name} AS {database}.{kind} ENGINE = Null")
    return name


def existing_columns(client, database: str, table: str) -> list[str]:
    return list(column_types(client, database, table))


def column_types(client, database: str, table: str) -> dict[str, str]:
    """Column name -> ClickHouse type, in table order."""
    return {name: ch_type for name, ch_type, _ in table_columns(client, database, table)}


def table_columns(client, database: str, table: str) -> list[tuple[str, str, str]]:
    """Each column's name, ClickHouse type and DEFAULT expression ('' for none), in table
    order."""
    result = client.query("SELECT name, type, default_expression FROM system.columns WHERE database = {db:String} "
                          "AND table = {t:String} ORDER BY position",
                          parameters={"db": database, "t": table})
    return [tuple(row) for row in result.result_rows]
