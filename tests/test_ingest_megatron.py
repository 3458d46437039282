"""The Megatron parser on real published logs (tests/data/logs, see PROVENANCE.md):
values read by hand from each file, through ``trainmon ingest --dry-run``."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import yaml

from trainmon.ingest import cli

LOGS = Path(__file__).parent / "data" / "logs"
LABELS = yaml.safe_load((LOGS / "LABELS.yaml").read_text())


def dry_run(capsysbinary, name: str, *args: str) -> list[dict]:
    """The records ``trainmon ingest --dry-run`` prints for a corpus log."""
    import json

    assert cli.main(["--dry-run", str(LOGS / name), *args]) == 0
    out = capsysbinary.readouterr().out
    return [json.loads(line) for line in out.splitlines()]


def of(records, kind):
    return [r for r in records if r["log"] == kind]


@pytest.mark.parametrize("name", sorted(n for n, lab in LABELS.items() if lab["format"] != "surogate"))
def test_every_corpus_log_reads_with_its_format_and_step_count(capsysbinary, name):
    records = dry_run(capsysbinary, name)
    steps = {(r["rank"], r["step"]) for r in of(records, "step")}
    label = LABELS[name]
    if "duplicate-rank-lines" in name:
        assert len(steps) < label["steps"]  # seven ranks print each step: one record each
    else:
        assert len(steps) == label["steps"]
        assert len(of(records, "step")) == label.get("step_records", label["steps"])
    ids = [r["event_id"] for r in records]
    assert len(ids) == len(set(ids))


def test_megatron_deepspeed_values_prefixes_memory_and_end(capsysbinary):
    records = dry_run(capsysbinary, "megatron-deepspeed-qwen25-7b-finetune-gradnorm.log")
    steps = {r["step"]: r for r in of(records, "step")}
    assert sorted(steps) == list(range(1, 21))
    first, spike = steps[1], steps[6]
    # iteration 1: "elapsed time per iteration (ms): 17420.8 | learning rate: 1.000E-05 |
    # global batch size: 4 | lm loss: 1.080963E+01 | loss scale: 1.0 | grad norm: 894.370"
    assert (first["duration_ms"], first["lr"], first["loss"], first["norm"]) == (17420.8, 1e-5, 10.80963, 894.37)
    assert first["global_batch_size"] == 4 and first["num_zeros"] == 0 and first["nan_iterations"] == 0
    assert spike["norm"] == 1802.206
    assert first["host"] == "sd-2"                       # the pdsh prefix names the host
    # "consumed tokens" 8192 per iteration -> step_tokens, and tokens/s from the duration
    assert steps[2]["step_tokens"] == 8192
    assert steps[2]["tokens_per_second"] == pytest.approx(8192 / steps[2]["duration_ms"] * 1000)
    memory = {r["rank"]: r for r in of(records, "allocator")}
    # "[Rank 0] (after 1 iterations) memory (MB) | allocated: 4300.5078125 | max allocated:
    # 10844.75732421875 | reserved: 11826.0 | max reserved: 11826.0"
    assert memory[0]["step"] == 1
    assert memory[0]["allocated"] == int(4300.5078125 * 2**20)
    assert memory[0]["peak_allocated"] == int(10844.75732421875 * 2**20)
    assert memory[0]["reserved"] == memory[0]["peak_reserved"] == 11826 * 2**20


def test_fp16_warmup_without_loss_or_grad_norm_timers_and_old_memory_line(capsysbinary):
    records = dry_run(capsysbinary, "megatron-lm-gpt2-2.6b-v100-fp16-loss-scale-warmup.log")
    first, second = of(records, "step")
    # " iteration 5/ 120000 | ... | loss scale: 268435456.0 | number of skipped iterations: 5 |"
    # every iteration of the interval was skipped: no loss and no grad norm were printed
    assert "loss" not in first and "norm" not in first
    assert first["loss_scale"] == 268435456.0 and first["skipped"] == 5
    # "time (ms) | forward: 11716.18 | backward: 4770.37 | ... | batch generator: 2.61"
    assert first["timers"]["forward"] == 11716.18 and first["timers"]["batch generator"] == 2.61
    assert second["timers"]["forward"] == 483.93 and second["loss_scale"] == 8388608.0
    (memory,) = of(records, "allocator")  # "after 5 iterations memory (MB) | allocated: ..."
    assert memory["step"] == 5 and memory["allocated"] == int(10250.5693359375 * 2**20)


def test_pre_2020_lines_without_colons_nan_loss_and_validation(capsysbinary):
    records = dry_run(capsysbinary, "megatron-transformer-xl-fp16-loss-scale-collapse.log")
    steps = {r["step"]: r for r in of(records, "step")}
    # " iteration 700/ 3000 | ... | learning rate 9.773E-06 | lm loss NAN | loss scale 4.0 |"
    assert math.isnan(steps[700]["loss"]) and steps[700]["loss_scale"] == 4.0
    assert steps[400]["lr"] == 6.3e-6 and steps[800]["loss_scale"] == 0.1
    # " validation loss at iteration 1000 | LM loss: 4.503653E+00 | LM PPL: 9.034661E+01"
    (evaluation,) = of(records, "eval")
    assert (evaluation["step"], evaluation["loss"], evaluation["perplexity"]) == (1000, 4.503653, 90.34661)


def test_megatron_bridge_iteration_log_over_several_lines(capsysbinary):
    (step,) = of(dry_run(capsysbinary, "megatron-core-bridge-dsv4-fp8mx-gradnorm-nan-wrapped.log"), "step")
    # "iteration 5/50 | elapsed time per iteration: 21392.5 ms |" then "learning rate: ... |
    # global batch size: 4096 |", "loss scale: 1.0 | grad norm: nan |", "number of skipped ..."
    assert step["step"] == 5 and step["total_steps"] == 50 and step["duration_ms"] == 21392.5
    assert step["global_batch_size"] == 4096 and math.isnan(step["norm"])
    assert step["skipped"] == 0 and step["nan_iterations"] == 0


def test_megatron_core_moe_and_mtp_losses(capsysbinary):
    records = dry_run(capsysbinary, "megatron-core-swift-qwen-next-moe-mtp-lines.log")
    (step,), (moe,) = of(records, "step"), of(records, "moe")
    assert step["loss"] == 0.8659112 and step["tflops_per_gpu"] == 131.7
    assert step["losses"] == {"load_balancing_loss": 3.304209, "mtp_1 loss": 0.6761752}
    assert moe == {**moe, "step": 1, "aux_loss": 3.304209}
    assert step["time"].startswith("2025-12-26T16:44:40")   # the line's own timestamp


def test_a_crash_before_the_first_step_ends_every_rank_with_its_reason(capsysbinary):
    records = dry_run(capsysbinary, "megatron-deepspeed-2node-dataset-missing-traceback-nccl-watchdog.log")
    ends = {r["rank"]: r for r in of(records, "run") if r["event"] == "end"}
    assert all(e["status"] == "failed" for e in ends.values())
    assert ends[4]["reason"].startswith("FileNotFoundError: [Errno 2] No such file or directory")
    assert ends[0]["reason"].startswith("NCCL watchdog timeout: Watchdog caught collective "
                                        "operation timeout: WorkNCCL(SeqNum=")
    # Besides the run records only its NCCL lines, as log events (tests/test_checkpoint_records.py).
    assert Counter(r["log"] for r in records if r["log"] != "log_event") == {"run": len(ends)}
