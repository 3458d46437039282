"""``python -m trainmon.consumers.alerts``: print the rules tables of docs/alerts.md, each
generated from the rules (rules/docs.py); ``--write docs/alerts.md`` replaces them there."""

import sys
from pathlib import Path

from .rules.docs import tables, update

if sys.argv[1:2] == ["--write"] and len(sys.argv) == 3:
    path = Path(sys.argv[2])
    path.write_text(update(path.read_text()))
elif len(sys.argv) == 1:
    print("\n\n".join(f"<!-- {heading} -->\n{table}" for heading, table in tables().items()))
else:
    sys.exit("usage: python -m trainmon.consumers.alerts [--write docs/alerts.md]")
