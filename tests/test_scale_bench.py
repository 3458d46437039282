"""The scale benchmark (benchmarks/scale.py) in its quick mode, against the session's
broker: 16 ranks, 120 steps at 30x through the real ClickHouse and alerts services (each
its own process) from two sender processes. Exactly the injected incidents fire, naming
the right ranks, and every record becomes a row. No timing is asserted."""

from __future__ import annotations

from .benchmark_scripts import load_benchmark

scale = load_benchmark("scale")


def test_quick_run_fires_exactly_the_injected_incidents(bootstrap, tmp_path, capsys):
    scn = scale.quick()
    res = scale.run(scn, bootstrap, tmp_path / "scale", progress=lambda *_: None)

    assert res.extra == [], [(a.rule, a.ranks, a.step, a.message) for a in res.extra]
    fired = [(i.rule, i.alert.ranks if i.alert else None) for i in res.incidents]
    assert fired == [("rank_mismatch", [scn.stop_rank]), ("straggler", [scn.straggler_ranks[0]]),
                     ("non_finite", [scn.nan_rank]), ("gpu_throttle", [scn.hot_rank])]
    mismatch, straggler, nan, hot = (i.alert for i in res.incidents)
    assert mismatch.step == scn.stop_step - 1  # the silent rank's last step
    assert straggler.step == scn.straggler_onsets[0] + res.settings["fire_after"] - 1
    assert nan.step == scn.nan_step and hot.step >= scn.hot_step
    for inc in res.incidents:
        assert f"rank {inc.rank}" in inc.alert.message and len(inc.alert.message) < scale.MESSAGE_LIMIT
    # Each incident resolves once (the NaN at the next finite loss, the others at the
    # run's end, as the ranks finish), and nothing else fires.
    assert sorted((a.rule, a.state) for a in res.alerts) == [
        ("gpu_throttle", "firing"), ("gpu_throttle", "resolved"),
        ("non_finite", "firing"), ("non_finite", "resolved"),
        ("rank_mismatch", "firing"), ("rank_mismatch", "resolved"),
        ("straggler", "firing"), ("straggler", "resolved")]
    assert res.rows == {"step": res.counts["step"], "gpu": res.counts["gpu"],
                        "allocator": res.counts["allocator"], "run": res.counts["run"]}
    assert res.counts["step"] == scn.ranks * scn.steps - (scn.steps - scn.stop_step)
    assert res.engine["records"] == res.counts["step"] + res.counts["gpu"] + res.counts["run"]
    assert f"{res.engine['records']} records" in res.engine["log"]  # the service's own count

    met = dict((name.split(":")[0], ok) for name, ok in scale.report(res))
    assert met["exactly the injected incidents fire, naming the right ranks"]
    assert "alerts of the run" in capsys.readouterr().out
