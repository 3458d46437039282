"""The corpus logs added for issue 29 ("more real runs": restarts, crashes on real clusters,
fp16, MoE; sources in tests/data/logs/PROVENANCE.md) read by a Session as ``trainmon
ingest`` would, in memory. The values checked were read off the logs by hand; the quoted
lines are the logs' own."""

from __future__ import annotations

import math

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


def test_megatron_core_moe_run_start_values_and_router_loss():
    session, records = ingest(raw_lines("megatron-core-moe-mcore012-first-iterations-healthy.log"))
    assert dict(session.sent) == {"run": 1, "step": 3, "moe": 3}
    steps, moe = by_step(records, "step"), by_step(records, "moe")
    # " [2025-05-09 06:11:17] iteration        1/      10 | ... elapsed time per iteration (ms):
    # 21847.9 | throughput per GPU (TFLOP/s/GPU): 4.5 | ... lm loss: 1.186396E+01 |
    # load_balancing_loss: 1.000977E+00 | ... grad norm: 6.321 | num zeros: 256053424.0 |"
    first = steps[1]
    assert (first.loss, first.norm, first.duration_ms, first.tflops_per_gpu) == (
        11.86396, 6.321, 21847.9, 4.5)
    assert (first.total_steps, first.num_zeros, first.global_batch_size) == (10, 256053424, 32)
    assert moe[1].aux_loss == 1.000977 and moe[3].aux_loss == 1.002058
    assert steps[3].loss == 8.431922  # the warm-up drop a rule must not call an incident


def test_nccl_watchdog_timeout_without_iteration_lines_ends_the_run_failed():
    _, records = ingest(raw_lines("megatron-lm-4gpu-second-iteration-nccl-watchdog-timeout.log"))
    (end,) = of_kind(records, "run")
    assert (end.event, end.status) == ("end", "failed")
    assert end.reason.startswith("NCCL watchdog timeout: Watchdog caught collective operation "
                                 "timeout: WorkNCCL(SeqNum=33, OpType=ALLREDUCE, Timeout(ms)=600000)")


def test_torchtitan_ten_step_moe_probe():
    session, records = ingest(raw_lines("torchtitan-h100-muon-moe-probe-10steps-healthy.log"))
    steps = by_step(records, "step")
    assert sorted(steps) == list(range(1, 11))
    # "step:  1  loss:  8.06529  grad_norm:  2.3906  memory:  0.61GiB(0.77%)  tps: 164"
    # "step: 10  loss:  6.09957  grad_norm:  8.3125  memory:  0.66GiB(0.84%)  tps: 2,233"
    assert (steps[1].loss, steps[1].norm, steps[1].tokens_per_second) == (8.06529, 2.3906, 164)
    assert (steps[10].loss, steps[10].norm, steps[10].tokens_per_second) == (6.09957, 8.3125, 2233)
    assert [(r.event, r.status) for r in of_kind(records, "run")] == [
        ("start", "running"), ("end", "success")]


def test_hf_trainer_nan_filtered_zero_losses_on_npu_are_nan():
    # {'loss': 1.4596, 'grad_norm': nan, ...} then three {'loss': 0.0, 'grad_norm': nan, ...}:
    # the Trainer's logging_nan_inf_filter averages NaN steps away, to 0 when all were NaN.
    _, records = ingest(raw_lines("hf-trainer-llamafactory-npu-gradnorm-nan-then-zero-loss.log"))
    steps = by_step(records, "step")
    assert steps[1].loss == 1.4596 and math.isnan(steps[1].norm)
    assert all(math.isnan(steps[s].loss) and math.isnan(steps[s].norm) for s in (2, 3, 4))


def test_hf_trainer_isolated_nan_grad_norms_keep_their_finite_loss():
    _, records = ingest(raw_lines("hf-trainer-time-moe-finetune-intermittent-gradnorm-nan.log"))
    steps = by_step(records, "step")
    assert [s for s, r in steps.items() if math.isnan(r.norm)] == [1, 4]
    assert (steps[1].loss, steps[4].loss) == (0.1474, 0.1819)
    assert steps[2].norm == 0.1899697184562683


def test_hf_trainer_string_values_and_padded_dicts():
    _, strings = ingest(raw_lines("hf-trainer-sentence-transformers-string-values-midrun-healthy.log"))
    # {'loss': '0.91', 'grad_norm': '0.8618', 'learning_rate': '3.094e-07', 'epoch': '0.6623'}
    first = by_step(strings, "step")[1]
    assert (first.loss, first.norm, first.lr) == (0.91, 0.8618, 3.094e-07)
    _, padded = ingest(raw_lines("hf-trainer-tinystories-fresh-start-loss-drop-healthy.log"))
    assert [r.loss for r in of_kind(padded, "step")] == [
        2.1048, 1.2131, 1.0123, 0.9023, 0.844, 0.7894, 0.7573]


def test_swift_moe_8gpu_run_with_grad_norm_spikes():
    name = "hf-trainer-ms-swift-gemma4-26b-a4b-moe-8gpu-fsdp2-gradnorm-spikes.log"
    session, records = ingest(raw_lines(name))
    assert dict(session.sent) == {"run": 2, "step": 30, "allocator": 30, "log_event": 5}
    steps = by_step(records, "step")
    assert sorted(steps) == list(range(1, 31))  # from 'global_step/max_steps': 'N/30'
    # the labelled spikes: 'grad_norm': '140' (9), '177' (12), '142' (18)
    assert {s: steps[s].norm for s in (8, 9, 10, 11, 12, 13, 17, 18, 19)} == {
        8: 33.25, 9: 140.0, 10: 6.125, 11: 8.5, 12: 177.0, 13: 8.5, 17: 13.94, 18: 142.0, 19: 5.781}
    assert (steps[1].loss, steps[30].loss) == (2.383, 1.249)
    assert [(r.event, r.status) for r in of_kind(records, "run")] == [
        ("start", "running"), ("end", "success")]
    assert {r.step for r in of_kind(records, "allocator")} == set(range(1, 31))
