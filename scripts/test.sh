#!/usr/bin/env bash
# The test command: sets up what is needed, then runs the whole suite against a real
# Kafka broker (started by the test fixtures), chDB, and the real W&B / Aim / TB libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
