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
exec "${pytest[@]}" tests
