#!/usr/bin/env bash
# The main job: sets up what is needed, then runs the end-to-end demo; prints how long it
# all took (also when it fails), the setup and the demo apart.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
demo_started=
report_time() {
    local total=$((SECONDS - started))
    if [[ -n $demo_started ]]; then
        echo "scripts/demo.sh: total ${total} s (setup $((demo_started - started)) s, demo $((SECONDS - demo_started)) s)"
    else
        echo "scripts/demo.sh: total ${total} s (stopped during setup)"
    fi
}
trap report_time EXIT
scripts/bootstrap.sh
demo_started=$SECONDS
.venv/bin/trainmon demo "$@"
