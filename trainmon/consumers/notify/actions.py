"""Actions: a command run for an incident -- ``scancel $SLURM_JOB_ID`` on a critical NaN,
a stop file the training loop watches -- with the alert as JSON on stdin and as
TRAINMON_ALERT_* environment variables, a time limit, and its output logged.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

from ...schemas import AlertRecord
from .config import Action

log = logging.getLogger("trainmon.notify")


def alert_env(alert: AlertRecord) -> dict[str, str]:
    fields = {"RULE": alert.rule, "SEVERITY": alert.severity, "STATE": alert.state,
              "RUN_ID": alert.run_id, "HOST": alert.host, "INCIDENT_ID": alert.incident_id,
              "EVENT_ID": alert.event_id, "MESSAGE": alert.message,
              "STEP": "" if alert.step is None else str(alert.step),
              "VALUE": "" if alert.value is None else repr(alert.value),
              "THRESHOLD": "" if alert.threshold is None else repr(alert.threshold),
              "RANKS": ",".join(str(r) for r in alert.ranks)}
    return {f"TRAINMON_ALERT_{k}": v for k, v in fields.items()}


def run_action(action: Action, alert: AlertRecord, timeout_s: float) -> int | None:
    """Run it once; its exit status, or None when it ran past ``timeout_s`` (killed)."""
    document = alert.model_dump_json()
    env = {**os.environ, **alert_env(alert)}
    log.info("trainmon notify: action for %s: %s", alert.incident_id, action.command)
    # A session of its own: at the timeout the whole group goes, not only the shell.
    process = subprocess.Popen(action.command, shell=True, env=env, text=True, start_new_session=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = process.communicate(document, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        log.error("trainmon notify: action for %s ran past %.0f s, killed: %s (stdout: %r stderr: %r)",
                  alert.incident_id, timeout_s, action.command, stdout[-2000:], stderr[-2000:])
        return None
    level = logging.INFO if process.returncode == 0 else logging.ERROR
    log.log(level, "trainmon notify: action for %s exited %d; stdout: %r stderr: %r",
            alert.incident_id, process.returncode, stdout[-2000:], stderr[-2000:])
    return process.returncode
