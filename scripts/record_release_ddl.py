"""Print the DDL an older trainmon runs on a fresh ClickHouse database (docs/upgrades.md).

    .venv/bin/python scripts/record_release_ddl.py 3763773 > tests/data/clickhouse_v0_ddl.sql

Checks the commit out into a temporary ``git worktree``, runs that commit's own
``create_all`` against a fresh chDB directory with a client that records every statement
it sends, prints them (';'-terminated, a blank line between), and removes the worktree.
A test then creates a database from that file and has today's loader migrate it.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs inside the old checkout (its directory first on sys.path), not this one.
_RECORD = """
import sys
sys.path.insert(0, sys.argv[1])
import trainmon
assert trainmon.__file__.startswith(sys.argv[1]), trainmon.__file__
from trainmon.consumers.clickhouse.client import Target, connect
from trainmon.consumers.clickhouse import create_all


class Recording:
    def __init__(self, client):
        self.client, self.statements = client, []

    def command(self, sql, *args, **kwargs):
        self.statements.append(sql.strip().rstrip(";"))
        return self.client.command(sql, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)


client = Recording(connect(Target(path=sys.argv[2])))
create_all(client, "trainmon")
print("".join(statement + ";\\n\\n" for statement in client.statements), end="")
"""


def main(commit: str) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "trainmon"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True,
                       stdout=subprocess.DEVNULL)
        try:
            done = subprocess.run([sys.executable, "-c", _RECORD, str(tree), str(Path(scratch) / "chdb")],
                                  cwd=scratch, capture_output=True, text=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        return done.returncode
    sys.stdout.write(done.stdout)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
