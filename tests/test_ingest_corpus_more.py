"""The corpus logs added for issue 29 ("more real runs": restarts, crashes on real clusters,
fp16, MoE; sources in tests/data/logs/PROVENANCE.md) read by a Session as ``trainmon
ingest`` would, in memory. The values checked were read off the logs by hand; the quoted
lines are the logs' own."""

from __future__ import annotations

from .ingest_support import LABELS, by_step, ingest, of_kind, raw_lines

RETRY = "megatron-deepspeed-v100-2node-retry-after-stop-healthy.log"
STOPPED = "megatron-deepspeed-v100-2node-log-stops-iter8.log"
TITAN_OOM = "torchtitan-h100-131k-tokens-oom-first-step.log"


def test_retry_is_the_restart_of_the_run_whose_log_stops_at_iteration_8():
    assert LABELS[RETRY]["restart_of"] == STOPPED
    _, stopped = ingest(raw_lines(STOPPED))
    session, retry = ingest(raw_lines(RETRY))
    assert session.format == "megatron" and not session.rejected
    # The first attempt's log ends after iteration 8 of 20 with no run end; the retry
    # starts again at iteration 1 (no checkpoint) and ends cleanly.
    assert max(by_step(stopped, "step")) == 8 and not [
        r for r in of_kind(stopped, "run") if r.event == "end"]
    steps = by_step(retry, "step")
    assert sorted(steps) == list(range(1, 21))
    # " iteration        1/      20 | ... | elapsed time per iteration (ms): 18654.1 | ...
    # lm loss: 1.263473E+01 | loss scale: 1.0 | grad norm: 28.533 |"
    assert (steps[1].loss, steps[1].norm, steps[1].duration_ms) == (12.63473, 28.533, 18654.1)
    assert (steps[20].loss, steps[20].norm) == (10.30596, 15.53)
    assert steps[1].host == "v100x16-2"  # the pdsh prefix of the rank that prints
    ends = [r for r in of_kind(retry, "run") if r.event == "end"]
    assert ends and {r.status for r in ends} == {"success"}


def test_torchtitan_oom_before_the_first_metrics_line():
    # Read as torchtitan from "Training starts at step 1" alone; the run ends failed with
    # the OOM as its reason, before any step record.
    session, records = ingest(raw_lines(TITAN_OOM))
    assert session.format == "torchtitan" == LABELS[TITAN_OOM]["format"]
    assert not of_kind(records, "step")
    (end,) = of_kind(records, "run")
    assert (end.event, end.status) == ("end", "failed")
    assert end.reason.startswith("CUDA out of memory: torch.OutOfMemoryError: CUDA out of "
                                 "memory. Tried to allocate 640.00 MiB.")


TITAN_RESUME = "torchtitan-llama3-8b-resume-at-step-400-two-excerpts.log"


def test_torchtitan_resumed_run_is_read_with_its_final_save():
    # "Training starts at step 401." (with the old full stop) names the format; "Saving a full
    # checkpoint at last step, step 1000." then "Finished saving ... in 49.21 seconds."
    session, records = ingest(raw_lines(TITAN_RESUME))
    assert session.format == "torchtitan" and LABELS[TITAN_RESUME]["resumes_from_step"] == 400
    saves = [(r.event, r.step, r.duration_ms) for r in of_kind(records, "checkpoint")]
    assert saves == [("started", 1000, None), ("saved", 1000, 49210.0)]
