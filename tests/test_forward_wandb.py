"""W&B forwarder: real broker, a real offline W&B run, read back with wandb's own reader
of the run's .wandb transaction log (``wandb leet inspect --json``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .forward_helpers import CONFIG, assert_series, drain, expected_series, flat, log_run, make_forwarder

wandb = pytest.importorskip("wandb")
from trainmon.consumers.wandb_sink import STATE_DIR, WandbSink, wandb_run_id  # noqa: E402


def wandb_files(directory: Path, run_id: str) -> list[Path]:
    return sorted(directory.glob(f"wandb/offline-run-*-{wandb_run_id(run_id)}/run-*.wandb"))


def inspect(path: Path) -> list[dict]:
    wandb_cli = shutil.which("wandb", path=str(Path(sys.executable).parent)) or "wandb"
    out = subprocess.run([wandb_cli, "leet", "inspect", "--json", str(path)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def read_run(directory: Path, run_id: str):
    """(scalar series name -> [(step, value)], media name -> [(step, value)], config, run records)."""
    series, media, config, runs = {}, {}, {}, []
    for path in wandb_files(directory, run_id):
        for entry in inspect(path):
            if entry["type"] == "run":
                runs.append(entry["run"])
                config.update(entry["run"].get("config", {}).get("update", {}))
            elif entry["type"] == "config":
                config.update(entry["config"].get("update", {}))
            elif entry["type"] == "history":
                item = entry["history"]["item"]
                # Media (an image) is flattened into "<name>._type", "<name>.path", ...
                objects = {key.removesuffix("._type"): {} for key in item if key.endswith("._type")}
                for key, value in item.items():
                    name, _, attribute = key.partition(".")
                    if name in objects:
                        objects[name][attribute] = value
                    elif not key.startswith("_") and key != "step":
                        series.setdefault(key, []).append((item["step"], value))
                for name, value in objects.items():
                    media.setdefault(name, []).append((item["step"], value))
    return series, media, config, runs


def test_wandb_offline_run_holds_exactly_the_logged_series_also_after_replay(
        make_producer, bootstrap, topic_prefix, tmp_path):
    sent = log_run(make_producer, "wb-run/1")  # a run id W&B would not take as is
    directory = tmp_path / "wb"

    sink = WandbSink(directory=directory, mode="offline")
    forwarder = make_forwarder(sink, bootstrap, topic_prefix, "wb-1", directory / STATE_DIR)
    drain(forwarder, sent)
    sink.close()
    forwarder.stream.close()

    assert len(wandb_files(directory, "wb-run/1")) == 1
    series, media, config, runs = read_run(directory, "wb-run/1")
    assert_series(series, flat(expected_series()))
    assert runs[0]["run_id"] == wandb_run_id("wb-run/1")
    assert runs[0]["project"] == "trainmon-tests" and runs[0]["display_name"] == "wb-run/1-name"
    assert config["model"] == CONFIG["model"] and config["lr"] == CONFIG["lr"]
    assert config["trainmon"]["run_id"] == "wb-run/1"
    # The allocator breakdown: one pie chart image at the allocator record's step.
    [(step, pie)] = media["allocator/breakdown"]
    assert step == 3 and pie["_type"] == "image-file"
    assert list(directory.glob(f"wandb/offline-run-*/files/{pie['path']}"))

    # A forced replay (a new group, a new forwarder process's sink): nothing new to send,
    # so no W&B run is even opened, and the offline run keeps exactly its points.
    sink = WandbSink(directory=directory, mode="offline")
    replay = make_forwarder(sink, bootstrap, topic_prefix, "wb-replay", directory / STATE_DIR)
    drain(replay, sent)
    sink.close()
    replay.stream.close()
    assert replay.stats.skipped == sent
    assert len(wandb_files(directory, "wb-run/1")) == 1
    assert read_run(directory, "wb-run/1")[0] == series


def test_a_run_made_again_after_it_was_finished_keeps_the_project_and_name_of_its_start(tmp_path):
    """A run's start may be long read when W&B makes the run again: finished after its
    end and then given late points, or after the forwarder restarted. The start's project
    and name (kept in the run's progress) name it then too, not W&B's default."""
    from trainmon.consumers.forwarding import RunProgress, RunWork, config_updates
    from trainmon.schemas import RunRecord, StepRecord

    from .samples import envelope

    start = RunRecord(**envelope(1, rank=0, run_id="late-run"), event="start", status="running",
                      project="proj-late", name="late-name")
    progress = RunProgress("late-run", config=config_updates(start))
    step = StepRecord(**envelope(2, rank=0, run_id="late-run"), step=1, loss=2.5)
    late = StepRecord(**envelope(3, rank=1, run_id="late-run"), step=2, loss=2.25)

    sink = WandbSink(directory=tmp_path / "first", mode="offline")
    sink.write(RunWork("late-run", progress, records=[step], config=progress.config, start=start))
    sink.close()  # finished, as after its end's grace or a forwarder's stop
    # Later: only points, in a batch without the start (another sink: a restarted forwarder;
    # another directory: offline, a run's directory is named by the second it was made in).
    sink = WandbSink(directory=tmp_path / "again", mode="offline")
    sink.write(RunWork("late-run", progress, records=[late]))
    sink.close()

    for directory, point in (("first", ("train/loss", (1, 2.5))), ("again", ("rank1/train/loss", (2, 2.25)))):
        series, _, _, [run] = read_run(tmp_path / directory, "late-run")
        assert series[point[0]] == [point[1]]
        assert (run["project"], run["display_name"]) == ("proj-late", "late-name")
