"""Regenerate trainmon/kafka_jars.json from infra/kafka/pom.xml (run after changing it).

    .venv/bin/python scripts/pin_kafka_jars.py

Maven resolves the broker's runtime classpath once, here; the list of jars it chose
(group, artifact, version) and each jar's SHA-256 go into the package, so that
`trainmon broker fetch` can fetch them on any machine without Maven, and verify them.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POM = REPO / "infra" / "kafka" / "pom.xml"
OUT = REPO / "trainmon" / "kafka_jars.json"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        listing, jars = Path(tmp) / "deps.txt", Path(tmp) / "jars"
        mvn = ["mvn", "-B", "-q", "-Dstyle.color=never", "-f", str(POM)]
        subprocess.run([*mvn, "dependency:list", "-DincludeScope=runtime", f"-DoutputFile={listing}"], check=True)
        subprocess.run([*mvn, "dependency:copy-dependencies", "-DincludeScope=runtime",
                        f"-DoutputDirectory={jars}"], check=True)
        pinned = []
        for group, artifact, version in sorted(re.findall(r"^\s+([\w.-]+):([\w.-]+):jar:([\w.-]+):(?:compile|runtime)",
                                                          listing.read_text(), re.M)):
            data = (jars / f"{artifact}-{version}.jar").read_bytes()
            pinned.append({"group": group, "artifact": artifact, "version": version,
                           "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
    OUT.write_text(json.dumps({"generated_from": "infra/kafka/pom.xml", "jars": pinned}, indent=1) + "\n")
    print(f"{len(pinned)} jars pinned in {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
