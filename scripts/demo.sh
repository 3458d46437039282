#!/usr/bin/env bash
# The main job: sets up what is needed, then runs the end-to-end demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/trainmon demo "$@"
