"""The long real logs of the corpus (tests/data/logs/modded-nanogpt-*.log, complete
modded-nanogpt runs of 1,480-1,555 steps; sources in PROVENANCE.md) read by a Session as
``trainmon ingest`` would, in memory. The values checked were read off the logs by hand."""

from __future__ import annotations

import math

import pytest

from trainmon.ingest.formats import FORMATS
from trainmon.ingest.formats.modded_nanogpt import ModdedNanoGptParser
from trainmon.ingest.formats.nanogpt import NanoGptParser
from trainmon.ingest.lines import split_line

from .ingest_support import LABELS, LOGS, by_step, ingest, raw_lines

VALUEEMBED = "modded-nanogpt-valueembed-record-train-loss-healthy.log"
BIAS = "modded-nanogpt-bias-experiment-h100-pcie-healthy.log"
BASELINE = "modded-nanogpt-baseline-2026-batch-schedule-healthy.log"
LONG = [VALUEEMBED, BIAS, BASELINE]


@pytest.fixture(scope="module")
def ingested() -> dict:
    return {name: ingest(raw_lines(name)) for name in LONG}


@pytest.mark.parametrize("name", LONG)
def test_long_log_is_labelled_and_every_step_line_is_a_record(name, ingested):
    session, records = ingested[name]
    label = LABELS[name]
    assert label["format"] == "modded-nanogpt" and session.format == "modded-nanogpt"
    assert session.sent["step"] == label["steps"]
    assert not session.rejected
    steps = [r.step for r in records if r.kind == "step"]
    assert steps == list(range(1, label["steps"] + 1))  # every step, once, in order
    # Every step has a duration: step 1 from the clock's start, the others from the
    # difference of train_time (the 2024 clock restart after 10 steps included).
    assert all(r.duration_ms is not None and r.duration_ms > 0
               for r in records if r.kind == "step")
    # The final validation (step M/M) ends the run.
    assert [(r.event, r.status) for r in records if r.kind == "run"] == [
        ("start", "running"), ("end", "success")]


def test_valueembed_record_train_loss_clock_restart_and_spikes(ingested):
    session, records = ingested[VALUEEMBED]
    assert dict(session.sent) == {"run": 2, "step": 1530, "eval": 14}
    steps, evals = by_step(records, "step"), by_step(records, "eval")
    # "step:1/1530 train_loss:10.8258 train_time:31613ms step_avg:nanms" (compilation)
    assert (steps[1].loss, steps[1].duration_ms, steps[1].total_steps) == (10.8258, 31613, 1530)
    # "step:10/1530 ... train_time:33005ms", then the clock restarts:
    # "step:11/1530 train_loss:6.4584 train_time:114ms", "step:12/1530 ... train_time:274ms"
    assert (steps[11].loss, steps[11].duration_ms, steps[12].duration_ms) == (6.4584, 114, 160)
    # "step:1529/1530 ... train_time:264375ms",
    # "step:1530/1530 train_loss:3.2364 train_time:264554ms"
    assert (steps[1530].loss, steps[1530].duration_ms) == (3.2364, 179)
    assert steps[946].loss == 5.0685  # the largest single-step spike after step 100
    assert steps[189].duration_ms == 336  # one of the periodic ~2x slow steps
    assert sorted(evals) == [0, *range(125, 1501, 125), 1530]
    assert (evals[0].loss, evals[1500].loss, evals[1530].loss) == (10.8258, 3.2776, 3.2751)
    assert steps[500].norm is None and steps[500].lr is None  # not printed


def test_bias_experiment_without_train_loss(ingested):
    session, records = ingested[BIAS]
    assert dict(session.sent) == {"run": 2, "step": 1480, "eval": 13}
    steps, evals = by_step(records, "step"), by_step(records, "eval")
    assert all(r.loss is None for r in steps.values())  # the script prints no train loss
    # "step:1/1480 train_time:42113ms", "step:10/1480 train_time:44566ms",
    # "step:11/1480 train_time:251ms step_avg:nanms"
    assert (steps[1].duration_ms, steps[10].duration_ms, steps[11].duration_ms) == (42113, 259, 251)
    # "step:1479/1480 train_time:408663ms", "step:1480/1480 train_time:408953ms"
    assert steps[1480].duration_ms == 290
    # "step:0/1480 val_loss:7.7109" (after "Centered output layer, initial loss ...")
    assert (evals[0].loss, evals[750].loss, evals[1480].loss) == (7.7109, 3.5784, 3.3001)


def test_baseline_2026_batch_size_schedule(ingested):
    session, records = ingested[BASELINE]
    assert dict(session.sent) == {"run": 2, "step": 1555, "eval": 8}
    steps, evals = by_step(records, "step"), by_step(records, "eval")
    # Compiled before the clock starts: "step:1/1555 train_time:75ms", "step:2/1555 train_time:92ms"
    assert (steps[1].duration_ms, steps[2].duration_ms) == (75, 17)
    # The first step after a validation: 66501ms at step 1250 -> 66629ms at step 1251
    assert steps[1251].duration_ms == 128
    # "step:1554/1555 train_time:92202ms", "step:1555/1555 train_time:92283ms"
    assert steps[1555].duration_ms == 81
    # Steps take longer as the schedule grows the batch: ~33 ms, ~59 ms, ~85 ms.
    assert steps[400].duration_ms < 40 < steps[800].duration_ms < 70 < steps[1300].duration_ms
    assert (evals[0].loss, evals[1000].loss, evals[1555].loss) == (10.8295, 3.5732, 3.2807)


@pytest.mark.parametrize("name", LONG)
def test_no_other_format_claims_a_line_of_the_long_logs(name):
    for raw in raw_lines(name):
        line = split_line(raw)
        claimed = [f for f, p in FORMATS.items() if f != "modded-nanogpt" and p.detect(line)]
        assert not claimed, f"{claimed} claim {raw!r}"


def test_modded_nanogpt_does_not_claim_a_line_of_the_other_logs():
    for path in sorted(LOGS.glob("*.log")):
        if path.name.startswith("modded-nanogpt"):
            continue
        for raw in path.read_bytes().decode("utf-8", errors="replace").split("\n"):
            for part in raw.rstrip("\r").split("\r"):
                assert not ModdedNanoGptParser.detect(split_line(part)), (path.name, part[:200])


def test_nanogpt_and_modded_nanogpt_lines_are_told_apart():
    modded = [
        "step:0/1530 val_loss:10.8258 train_time:0ms step_avg:nanms",
        "step:1/1530 train_loss:10.8258 train_time:31613ms step_avg:nanms",
        "step:13/1480 train_time:762ms step_avg:253.89ms",
    ]
    nanogpt = [
        # tests/data/logs/nanogpt-shakespeare-char-nan-loss.log
        "iter 0: loss 4.2709, time 10268.08ms, mfu -100.00%",
        "step 100: train loss 3.4633, val loss 3.4987",
    ]
    for text in modded:
        assert ModdedNanoGptParser.detect(split_line(text))
        assert not NanoGptParser.detect(split_line(text))
    for text in nanogpt:
        assert NanoGptParser.detect(split_line(text))
        assert not ModdedNanoGptParser.detect(split_line(text))


def test_validation_in_seconds_and_steps_printed_every_other_step():
    # modded-nanogpt records/track_3_optimization/results/20260504_soap_mlp_contra_normuon_3148/
    # seed01.txt prints train_time in seconds (and its validations only, to the log file).
    session, records = ingest([
        "step:125/3148 val_loss:4.54643 train_time:125.376s step_avg:1003.01ms",
        "step:3148/3148 val_loss:3.27888 train_time:618.893s step_avg:196.60ms"])
    assert session.format == "modded-nanogpt"
    assert [(r.step, r.loss) for r in records if r.kind == "eval"] == [(125, 4.54643),
                                                                      (3148, 3.27888)]
    # A script printing every k-th step: each step of the gap gets its share.
    kept = [raw for raw in raw_lines(BASELINE) if not raw.startswith("step:") or "val_loss" in raw
            or int(raw.split("/")[0][5:]) % 2 == 0]
    _, records = ingest(kept)
    steps = by_step(records, "step")
    assert 1 not in steps and steps[2].duration_ms is None  # no earlier step to measure from
    assert steps[1554].duration_ms == (92202 - 92033) / 2  # step:1552 ... 92033ms
    assert all(math.isfinite(r.duration_ms) for s, r in steps.items() if s > 2)
