"""Aim forwarder: real broker, a real Aim repository, read back with aim.Repo."""

from __future__ import annotations

import pytest

from .forward_helpers import CONFIG, assert_series, drain, expected_series, log_run, make_forwarder

aim = pytest.importorskip("aim")
from trainmon.consumers.aim_sink import STATE_DIR, AimSink  # noqa: E402


def aim_spelling(rank: int, name: str) -> tuple[str, dict]:
    if name.startswith("gpu/") and rank == 0:
        name = "gpu/0/" + name.removeprefix("gpu/")
    return name, {"subset": "eval" if name.startswith("eval/") else "train", "rank": rank}


def read_repo(path) -> dict[str, dict]:
    """trainmon run id -> {"run": ..., "series": {(name, rank, subset): [(step, value)]}}."""
    repo = aim.Repo.from_path(str(path))
    runs = {}
    for run in repo.iter_runs():
        series = {}
        for metric in run.metrics():
            context = metric.context.to_dict()
            steps, (values, _epochs, _times) = metric.data.items_list()
            key = (metric.name, context["rank"], context["subset"])
            assert key not in series
            series[key] = list(zip(steps, values))
        runs[run["trainmon"]["run_id"]] = {"run": run, "series": series}
    return runs


def test_aim_holds_exactly_the_logged_series_also_after_replay(
        make_producer, bootstrap, topic_prefix, tmp_path):
    sent = log_run(make_producer, "aim-run")
    repo_path = tmp_path / "aim"

    sink = AimSink(repo_path)
    forwarder = make_forwarder(sink, bootstrap, topic_prefix, "aim-1", repo_path / STATE_DIR)
    drain(forwarder, sent)
    sink.close()
    forwarder.stream.close()

    runs = read_repo(repo_path)
    assert list(runs) == ["aim-run"]
    run = runs["aim-run"]["run"]
    assert run.name == "aim-run-name"
    assert run.experiment == "trainmon-tests"
    assert run["hparams"]["model"] == CONFIG["model"]
    assert run.end_time is not None
    expected = {}
    for rank, series in expected_series().items():
        for name, points in series.items():
            aim_name, context = aim_spelling(rank, name)
            expected[f"{aim_name}|{context['rank']}|{context['subset']}"] = points
    actual = {"|".join(map(str, key)): points for key, points in runs["aim-run"]["series"].items()}
    assert_series(actual, expected)

    # A forced replay: a new consumer group and a new sink read every topic again.
    sink = AimSink(repo_path)
    replay = make_forwarder(sink, bootstrap, topic_prefix, "aim-replay", repo_path / STATE_DIR)
    drain(replay, sent)
    sink.close()
    replay.stream.close()
    assert replay.stats.skipped == sent
    again = read_repo(repo_path)
    assert list(again) == ["aim-run"]
    assert again["aim-run"]["series"] == runs["aim-run"]["series"]


def test_aim_finds_its_run_again_without_progress_files(make_producer, bootstrap, topic_prefix, tmp_path):
    repo_path = tmp_path / "aim"
    first = log_run(make_producer, "aim-lost", steps=range(2), end=False)
    sink = AimSink(repo_path)
    forwarder = make_forwarder(sink, bootstrap, topic_prefix, "aim-a", tmp_path / "state-a")
    drain(forwarder, first)
    sink.close()
    forwarder.stream.close()

    # Progress lost (a fresh state dir): the run is found by its trainmon run id, and
    # Aim keeps one value per step, so even re-sent points do not duplicate.
    second = log_run(make_producer, "aim-lost", steps=range(2, 4), start=False)
    sink = AimSink(repo_path)
    forwarder = make_forwarder(sink, bootstrap, topic_prefix, "aim-b", tmp_path / "state-b")
    drain(forwarder, first + second)
    sink.close()
    forwarder.stream.close()

    runs = read_repo(repo_path)
    assert list(runs) == ["aim-lost"]
    loss = runs["aim-lost"]["series"][("train/loss", 0, "train")]
    assert [s for s, _ in loss] == [0, 1, 2, 3]
