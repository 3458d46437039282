#!/usr/bin/env bash
# Sets up everything trainmon needs on a fresh machine, idempotently:
# a virtualenv in .venv, the Python packages (torch's CPU wheel from ../shared/wheels
# when present, to skip a multi-GB CUDA download), the Kafka broker's pinned jars from Maven Central (no Maven needed), and
# Debian's chromium for the browser test.
# Quiet when there is nothing to do; one progress line per long step otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
say() { printf '==> %s\n' "$*" >&2; }
# pip's own chatter (build-backend warnings) goes to a log shown only when pip fails.
pip_install() {
    local log=$VENV/pip-install.log
    if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        say "pip install failed; full log in $log"
        exit 1
    fi
}

if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtualenv in $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
fi

stamp="$VENV/.trainmon-installed"
want=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    pyver=$("$VENV/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    wheel=$(ls ../shared/wheels/torch-*+cpu-"$pyver"-*.whl 2>/dev/null | head -n1 || true)
    if [ -n "$wheel" ] && ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        say "installing torch (CPU) from $wheel"
        pip_install "$wheel"
    elif ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        say "no local torch wheel for $pyver; torch comes from PyPI"
    fi
    say "installing trainmon and its extras (a few minutes on a fresh machine)"
    pip_install -e '.[dev]'
    # Megatron-Bridge's callback system for its test; the package's own dependencies
    # (Megatron-Core, Transformer Engine) need a GPU, so without them (see the test).
    pip_install --no-deps "megatron-bridge==0.3.1"
    echo "$want" > "$stamp"
fi

# Debian's Chromium, for the report's browser test (headless). Root with apt-get only; a
# machine without it runs everything else.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing chromium (Debian package) for the browser test"
    if ! apt-get install -y -q chromium >/tmp/trainmon-apt.log 2>&1; then
        apt-get update -q >>/tmp/trainmon-apt.log 2>&1 || true
        apt-get install -y -q chromium >>/tmp/trainmon-apt.log 2>&1 || say "chromium not installed: see /tmp/trainmon-apt.log"
    fi
fi

# Kafka broker jars from Maven Central, checksums verified (cached outside git; prints only when fetching).
"$VENV/bin/python" -c 'from trainmon.broker import fetch; fetch()'
