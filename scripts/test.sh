#!/usr/bin/env bash
# The test command: sets up what is needed, then runs the whole suite against a real
# Kafka broker (started by the test fixtures), chDB, and the real W&B / Aim / TB libraries.
# With arguments, they go to one pytest run as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
pytest=(.venv/bin/python -m pytest -p no:cacheprovider)
if [ $# -gt 0 ]; then
    exec "${pytest[@]}" "$@"
fi

# The alerts tests run the alert service inside the pytest process. With kafka-python
# 3.0.12 a consumer's coordinator lookup was seen to hang forever once many clients had
# come and gone in one process (never in a fresh one), so each alerts module gets a
# process of its own; everything else runs together.
# test_alerts_restart starts three services in each of its cases, and under CPU load the
# hang was still seen there once: each of its tests gets a process of its own.
status=0
"${pytest[@]}" tests $(printf -- '--ignore=%s ' tests/test_alerts_*.py) || status=$?
for module in tests/test_alerts_*.py; do
    if [ "$module" = tests/test_alerts_restart.py ]; then
        mapfile -t cases < <("${pytest[@]}" -o addopts= --collect-only -q "$module" | grep "::")
        for case in "${cases[@]}"; do
            "${pytest[@]}" "$case" || status=$?
        done
    else
        "${pytest[@]}" "$module" || status=$?
    fi
done
exit $status
