"""The log formats besides Megatron's (nanoGPT, HF Trainer, torchtitan, NeMo, Surogate's
JSON) read by a Session as ``trainmon ingest`` would: real logs from tests/data/logs/,
and real lines from public issues and pull requests (their source above each). Pure,
in memory: no broker."""

from __future__ import annotations

import io
import json
import math
from datetime import datetime, timezone

import pytest

from trainmon.ingest.cli import _DryRun
from trainmon.ingest.formats import FORMATS, by_name
from trainmon.ingest.formats.nemo import NemoParser
from trainmon.ingest.formats.torchtitan import TorchTitanParser
from trainmon.ingest.lines import split_line
from trainmon.producer.surogate import JsonLogFile
from trainmon.schemas import AllocatorRecord

from .ingest_support import LABELS, LOGS, by_step, ingest, of_kind, raw_lines

GIB = 1024 ** 3
# The allocator's peak_reserved field is being added to the schema; until then the
# records that carry it are refused by the session, and only the parser is checked.
PEAK_RESERVED = "peak_reserved" in AllocatorRecord.model_fields


def parsed(parser, text: str) -> list:
    return parser.feed(split_line(text))


# -- detection -------------------------------------------------------------------------


def expected_format(name: str) -> str:
    """The format LABELS.yaml gives the file (by any of its aliases), else its name's."""
    label = (LABELS.get(name) or {}).get("format")
    if label:
        return by_name(label).name
    return next(fmt for fmt in sorted(FORMATS, key=len, reverse=True) if name.startswith(fmt))


CORPUS = sorted(p.name for p in LOGS.glob("*.log"))


@pytest.mark.parametrize("name", CORPUS)
def test_no_other_format_claims_a_line_of_a_corpus_log(name):
    # Auto-detection asks each format in turn: every line of a log must be refused by
    # every format but its own, Megatron's included, or the wrong parser could win.
    expected = expected_format(name)
    for raw in raw_lines(name):
        for part in raw.rstrip("\r").split("\r"):
            line = split_line(part)
            claimed = [f for f, parser in FORMATS.items() if f != expected and parser.detect(line)]
            assert not claimed, f"{claimed} claim {part[:200]!r}"


@pytest.mark.parametrize("name", [n for n in CORPUS if not n.startswith("megatron")])
def test_auto_detection_names_the_format(name):
    session, _ = ingest(raw_lines(name))
    assert session.format == expected_format(name)


# -- nanoGPT ---------------------------------------------------------------------------

def test_nanogpt_nan_loss_eval_and_mfu_placeholder():
    session, records = ingest(raw_lines("nanogpt-*nan-loss*.log"))
    assert session.format == "nanogpt"
    assert dict(session.sent) == {"run": 1, "step": 91, "eval": 5, "checkpoint": 4, "log_event": 1}
    assert not session.rejected
    steps = by_step(records, "step")
    first = steps[0]  # "iter 0: loss 4.2709, time 10268.08ms, mfu -100.00%"
    assert (first.loss, first.duration_ms, first.step_tokens) == (4.2709, 10268.08, 512)
    assert first.sol_percent is None  # nanoGPT's placeholder until it has 5 iterations
    assert steps[5].sol_percent == 0.01
    assert steps[5].tokens_per_second == pytest.approx(512 * 1000 / 1431.27)
    assert steps[5].norm is None and steps[5].lr is None  # nanoGPT prints neither
    assert steps[420].loss == 3.5023
    assert math.isnan(steps[425].loss) and math.isnan(steps[450].loss)
    evals = by_step(records, "eval")
    assert sorted(evals) == [0, 100, 200, 300, 400]
    assert evals[100].loss == 3.4987  # "step 100: train loss 3.4633, val loss 3.4987"


def test_nanogpt_config_file_and_total_steps():
    session, records = ingest(raw_lines("nanogpt-tinystories*.log"))
    # run: its start, and its end at wandb's exit footer (tests/test_ingest_conventions.py)
    assert dict(session.sent) == {"run": 2, "step": 601, "eval": 25, "checkpoint": 37,
                                  "log_event": 1}
    start = of_kind(records, "run")[0]
    assert start.config["max_iters"] == 6000 and start.config["batch_size"] == 64
    assert start.config["wandb_run_name"] == "ts-50m-r1-0615"
    step = by_step(records, "step")[10]
    assert (step.total_steps, step.step_tokens, step.sol_percent) == (6000, 262144, 46.46)


# -- HF Trainer ------------------------------------------------------------------------

def test_hf_trainer_steps_from_progress_bars_and_the_end_of_training():
    session, records = ingest(raw_lines("hf-trainer-llamafactory-*healthy*.log"))
    assert session.format == "hf-trainer"
    steps = of_kind(records, "step")
    assert [s.step for s in steps] == [350, 360, 370, 380, 390, 400, 410]
    assert (steps[0].loss, steps[0].norm, steps[0].lr, steps[0].epoch) == (
        1.2881, 1.0653622150421143, 6.8055443396842945e-06, 2.56)
    end = of_kind(records, "run")[-1]
    assert (end.event, end.status) == ("end", "success")


def test_hf_trainer_nan_grad_norm_without_bars_counts_log_events():
    session, records = ingest(raw_lines("hf-trainer-modernbert*.log"))
    steps = of_kind(records, "step")
    assert [s.step for s in steps] == [1, 2, 3]
    assert all(math.isnan(s.norm) for s in steps)
    # 'loss': 0.0 beside 'grad_norm': nan is the Trainer's NaN filter (test_ingest_conventions.py)
    assert steps[0].loss == 0.2051 and all(math.isnan(s.loss) for s in steps[1:])


def test_hf_trainer_without_grad_norm_between_deepspeed_overflow_lines():
    session, records = ingest(raw_lines("hf-trainer-deepspeed-fp16*.log"))
    steps = of_kind(records, "step")
    (logged,) = [s for s in steps if s.loss is not None]
    assert (logged.step, logged.loss, logged.epoch) == (380, 2.0491, 0.28)
    assert logged.norm is None  # this Trainer version logged no grad norm
    # "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 64, reducing to 32"
    # after bar 378, then 32 -> 16 at 379, 16 -> 8 at 380, 8 -> 4 at 381, 4 -> 2 at 382.
    skipped = [(s.step, s.loss_scale, s.skipped, s.loss) for s in steps if s.loss is None]
    assert skipped == [(378, 32.0, 1, None), (379, 16.0, 1, None), (380, 8.0, 1, None),
                       (381, 4.0, 1, None), (382, 2.0, 1, None)]


def test_hf_trainer_line_numbered_paste_and_plain_dicts():
    _, records = ingest(raw_lines("hf-trainer-*line-numbered*.log"))
    assert [(s.step, s.loss) for s in of_kind(records, "step")] == [(20, 0.0)]
    _, records = ingest(raw_lines("hf-trainer-unsloth*.log"))
    steps = of_kind(records, "step")
    assert [s.step for s in steps] == list(range(1, 9))
    assert steps[3].norm == 92.10


def test_hf_trainer_ms_swift_string_values_on_bar_lines():
    session, records = ingest(raw_lines("hf-trainer-swift*.log"))
    steps = of_kind(records, "step")
    assert [s.step for s in steps] == list(range(283, 295))
    first = steps[0]  # 'loss': '1.153', 'grad_norm': '3.779', 'global_step/max_steps': '283/294'
    assert (first.loss, first.norm, first.lr, first.epoch, first.total_steps) == (
        1.153, 3.779, 8e-08, 0.9624, 294)
    assert of_kind(records, "run")[-1].status == "success"
    if PEAK_RESERVED:
        assert of_kind(records, "allocator")[0].peak_reserved == int(43.59 * GIB)


def test_hf_trainer_tensor_reprs_running_training_block_and_eval():
    lines = [
        # https://github.com/huggingface/transformers/pull/6998 (TF Trainer's output)
        "***** Running training *****",
        "  Num examples = 24000",
        "  Total optimization steps = 564",
        "{'loss': 18.6387, 'learning_rate': 4.9113474e-05, 'epoch': 0.05851063829787234, 'step': 10}",
        # https://github.com/huggingface/transformers/pull/29212 (grad norm as a tensor)
        "{'loss': 24.6648, 'grad_norm': tensor(1091.0826), 'learning_rate': 1e-05, 'epoch': 0.04, 'step': 5}",
        # https://github.com/huggingface/sentence-transformers/pull/2449 (no bars: counted)
        "{'loss': 1.5126, 'learning_rate': 1.2459016393442624e-05, 'epoch': 0.44}",
        "{'eval_loss': 1.2490781545639038, 'eval_pearson_cosine': 0.870816510562672, "
        "'eval_runtime': 49.1914, 'eval_samples_per_second': 119.431, "
        "'eval_steps_per_second': 0.061, 'epoch': 0.44}",
        "{'eval_snli_loss': 1.0988188982009888, 'eval_snli_runtime': 12.5746, "
        "'eval_snli_samples_per_second': 782.689, 'eval_snli_steps_per_second': 6.123, 'epoch': 0.07}",
    ]
    session, records = ingest(lines)
    assert session.format == "hf-trainer"
    steps = of_kind(records, "step")
    assert [(s.step, s.loss) for s in steps] == [(10, 18.6387), (5, 24.6648), (3, 1.5126)]
    assert steps[1].norm == 1091.0826 and steps[0].norm is None
    assert all(s.total_steps == 564 for s in steps)
    assert of_kind(records, "run")[0].config["num_examples"] == 24000
    first, second = of_kind(records, "eval")
    assert (first.step, first.loss, first.epoch) == (3, 1.2490781545639038, 0.44)
    assert first.duration_ms == pytest.approx(49191.4)
    assert (second.loss, second.duration_ms) == (1.0988188982009888, pytest.approx(12574.6))


def test_hf_trainer_counts_logging_steps_from_the_training_arguments():
    lines = [
        # TrainingArguments as the Trainer prints them (one per line; excerpt)
        "logging_first_step=False,",
        "logging_steps=100,",
        # https://github.com/AnswerDotAI/ModernBERT/issues/233
        "{'loss': 0.2051, 'grad_norm': nan, 'learning_rate': 9.774074342405685e-06, 'epoch': 0.53}",
        "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 9.773696745450087e-06, 'epoch': 0.53}",
    ]
    _, records = ingest(lines)
    assert [s.step for s in of_kind(records, "step")] == [100, 200]


# -- torchtitan ------------------------------------------------------------------------

def test_torchtitan_steps_and_training_completed():
    session, records = ingest(raw_lines("torchtitan-kimik3*.log"))
    assert session.format == "torchtitan"
    steps = by_step(records, "step")
    assert sorted(steps) == list(range(1, 21))
    first = steps[1]  # step:  1  loss:  8.20187  grad_norm:  2.7656  memory: ... tps: 94
    assert (first.loss, first.norm, first.tokens_per_second, first.tflops_per_gpu) == (
        8.20187, 2.7656, 94.0, 0.02)
    end = of_kind(records, "run")[-1]
    assert (end.event, end.status) == ("end", "success")
    if PEAK_RESERVED:
        assert session.sent["allocator"] == 20


def test_torchtitan_without_grad_norm_and_with_mfu_not_available():
    _, records = ingest(raw_lines("torchtitan-llama-dcp*.log"))
    steps = by_step(records, "step")
    assert sorted(steps) == [200, 210, 220, 230, 240, 250]
    assert steps[200].norm is None and steps[200].sol_percent == 34.29
    _, records = ingest(raw_lines("torchtitan-*mfu-na*.log"))
    step = by_step(records, "step")[1]  # "mfu: N/A"
    assert step.sol_percent is None and step.tflops_per_gpu == 0.32


def test_torchtitan_ranks_printing_the_same_line_make_one_step():
    _, records = ingest(raw_lines("torchtitan-moe-gate*duplicate-rank*.log"))
    steps = of_kind(records, "step")
    assert [s.step for s in steps] == [4, 5]
    assert steps[0].tokens_per_second == 10050.0


def test_torchtitan_memory_is_an_allocator_record_in_bytes():
    # https://github.com/pytorch/torchtitan/pull/1287
    line = ("[rank0]:[titan] 2025-06-16 22:30:50,322 - root - INFO - step: 200  loss:  6.1384  "
            "memory: 49.66GiB(52.28%)  tps: 5,856  tflops: 339.16  mfu: 34.29%")
    step, allocator = parsed(TorchTitanParser(), line)
    assert (step.kind, step.rank, step.fields["tokens_per_second"]) == ("step", 0, 5856.0)
    assert step.time == datetime(2025, 6, 16, 22, 30, 50, 322000, tzinfo=timezone.utc)
    assert allocator.kind == "allocator"
    assert allocator.fields == {"step": 200, "stats": [], "peak_reserved": int(49.66 * GIB)}


def test_torchtitan_validation_lines_are_evals():
    # A torchtitan run's console pasted in YerevaNN/3DMolGen: 8 ranks print each line.
    validate = ("[titan] 2026-01-16 02:42:36,857 - root - INFO - validate step:  1  loss: 12.4699  "
                "memory: 69.81GiB(88.17%)  tps: 74,600")
    step = ("[titan] 2026-01-16 02:42:48,277 - root - INFO - step: 20  loss: 11.8347  grad_norm:  "
            "4.6875  memory: 69.83GiB(88.19%)  tps: 40,890  tflops: 261.49  mfu: 26.44%")
    session, records = ingest([validate] * 6 + [step] * 8)
    assert session.format == "torchtitan"
    (evaluation,) = of_kind(records, "eval")
    assert (evaluation.step, evaluation.loss, evaluation.tokens_per_second) == (1, 12.4699, 74600.0)
    (only,) = of_kind(records, "step")
    assert (only.step, only.norm, only.sol_percent) == (20, 4.6875, 26.44)


# -- NeMo ------------------------------------------------------------------------------

def test_nemo2_progress_printer_steps_and_val_loss_once():
    session, records = ingest(raw_lines("nemo*bionemo-esm2*.log"))
    assert session.format == "nemo"
    steps = by_step(records, "step")
    assert sorted(steps) == list(range(120, 126))
    first = steps[120]
    assert (first.loss, first.lr, first.consumed_samples, first.global_batch_size) == (
        1.233, 3e-05, 121, 1)
    assert first.duration_ms == pytest.approx(31.46)
    (evaluation,) = of_kind(records, "eval")  # val_loss: 4.106 repeats on every line
    assert (evaluation.step, evaluation.loss) == (120, 4.106)


def test_nemo2_steps_from_zero():
    session, records = ingest(raw_lines("nemo*moe-loss-logging*.log"))
    steps = of_kind(records, "step")
    assert [s.step for s in steps] == list(range(9))
    assert (steps[0].loss, steps[-1].loss, steps[0].total_steps) == (11.02, 7.113, 9)


def test_nemo2_memory_and_tflops():
    # https://github.com/NVIDIA-NeMo/Speech/issues/14850 (srun --label's "0: " in front)
    line = (" 0: Training epoch 0, iteration 8/29 | lr: 5.389e-06 | global_batch_size: 512 | "
            "global_step: 8 | max_memory_reserved: 57466159104 | max_memory_allocated: "
            "53930270720 | reduced_train_loss: 10.22 | train_step_timing in s: 27.01 | "
            "consumed_samples: 4608 | TFLOPS_per_GPU: 48.58")
    step, allocator = parsed(NemoParser(), line)
    assert (step.fields["step"], step.fields["tflops_per_gpu"], step.fields["duration_ms"]) == (
        8, 48.58, pytest.approx(27010.0))
    assert allocator.fields == {"step": 8, "stats": [], "peak_reserved": 57466159104,
                                "peak_allocated": 53930270720}


def test_nemo1_bar_with_a_rounded_global_step_counts_steps_from_the_bar():
    # Lightning prints global_step with 3 significant digits past 1e4 ("global_step=3.2e+4"):
    # the step is then the bar's counter less one. Built from the line of
    # https://github.com/NVIDIA/NeMo-Framework-Launcher/issues/55 with a later counter.
    line = ("Epoch 0:  41%|####      | 32040/77225 [9:07:58<878:01:48, 41.36s/it, loss=3.1, v_num=, "
            "reduced_train_loss=2.590, global_step=3.2e+4, consumed_samples=2.56e+7]")
    session, records = ingest([line])
    assert session.format == "nemo"
    (step,) = of_kind(records, "step")
    assert (step.step, step.loss) == (32039, 2.59)
    assert step.epoch == pytest.approx(32040 / 77225)
    assert step.consumed_samples is None  # 2.56e+7 is rounded to 3 digits: not a count


def test_nemo1_bar_redraws_make_one_step_each_with_its_own_metrics():
    # https://github.com/NVIDIA/NeMo-Framework-Launcher/issues/55
    real = ("Epoch 0:   1%|          | 795/77225 [9:07:58<878:01:48, 41.36s/it, loss=3.1, v_num=, "
            "reduced_train_loss=3.090, global_step=794.0, consumed_samples=1.63e+6]")
    session, records = ingest([real])
    (step,) = of_kind(records, "step")
    assert (step.step, step.loss, step.consumed_samples) == (794, 3.09, None)
    # Lightning draws a new counter first with the previous step's metrics, then again
    # with its own, all on one line of carriage returns; built from the line above.
    draw = ("Epoch 0:   1%|          | {n}/77225 [9:07:58<878:01:48, 41.36s/it, loss=3.1, v_num=, "
            "reduced_train_loss={loss}, global_step={step}, consumed_samples=1.63e+6]")
    redraws = "\r".join([draw.format(n=795, loss="3.090", step="794.0"),
                         draw.format(n=796, loss="3.090", step="794.0"),
                         draw.format(n=796, loss="3.050", step="795.0"),
                         draw.format(n=797, loss="3.050", step="795.0")])
    _, records = ingest([redraws])
    assert [(s.step, s.loss) for s in of_kind(records, "step")] == [(794, 3.09), (795, 3.05)]


# -- Surogate's JSON log ---------------------------------------------------------------

# As Surogate's TrainingRunLogger writes its file (invergent-ai/surogate,
# csrc/src/training/logging.cpp: a JSON array, one object per line, NaN as "nan").
SUROGATE_FILE = """[
  {"log": "option", "time": "2026-01-15 10:29:58.000000123", "step": 0, "name": "learning_rate", "value": 0.0002},
  {"log": "gpu-model", "time": "2026-01-15 10:29:58.1", "rank": 1, "step": 0, "id": 0, "name": "NVIDIA H100 80GB HBM3", "l2_size": 52428800, "sm_count": 132, "major": 9, "minor": 0, "memory": 85045854208, "free": 84000000000, "reserved": 0, "uuid": "ab12", "ecc": 1, "shared_mem": 233472, "cuda_driver": 12040, "cuda_runtime": 12040},
  {"log": "allocator", "time": "2026-01-15 10:29:59.5", "step": 0, "stats": [{"name": "weights", "device": 4294967296, "managed": 0, "pinned": 0, "pageable": 0}]},
  {"log": "step", "time": "2026-01-15 10:30:00.123456789", "step": 100, "epoch": 1.25, "step_tokens": 16384, "duration_ms": 156, "norm": "nan", "loss": 2.3456, "lr": 0.0002, "phase": "warmup"},
  {"log": "eval", "time": "2026-01-15 10:35:00.123456", "step": 100, "epoch": 1.25, "eval_tokens": 32768, "duration_ms": 234, "loss": 2.1234},
  {"log": "sol", "time": "2026-01-15 10:35:01", "rank": 0, "step": 0, "blocks": 1, "lm_head": 2, "attention": 3, "tps": 4, "tf32_peak": 1, "bf16_peak": 1, "fp16_peak": 1, "fp8_peak": 1}
]
"""

# invergent-ai/surogate, docs/guides/metrics.md ("JSON Log Format"): pretty-printed.
SUROGATE_PRETTY = """{
  "log": "moe",
  "time": "2026-01-15T10:30:00.123456",
  "step": 100,
  "aux_loss": 0.0234,
  "z_loss": 0.0012,
  "expert_utilization": 0.9375,
  "load_imbalance": 1.45
}
"""


def test_surogate_json_array_file():
    session, records = ingest(SUROGATE_FILE.split("\n"))
    assert session.format == "surogate"
    assert not session.rejected
    step = by_step(records, "step")[100]
    assert math.isnan(step.norm) and step.loss == 2.3456 and step.step_tokens == 16384
    assert step.tokens_per_second == pytest.approx(16384 * 1000 / 156)
    assert step.time == datetime(2026, 1, 15, 10, 30, 0, 123456, tzinfo=timezone.utc)
    evaluation = by_step(records, "eval")[100]
    assert (evaluation.loss, evaluation.eval_tokens, evaluation.duration_ms) == (2.1234, 32768, 234)
    (gpu,) = of_kind(records, "gpu_model")
    assert (gpu.rank, gpu.name, gpu.ecc, gpu.cuda_driver) == (1, "NVIDIA H100 80GB HBM3", True, "12040")
    (allocator,) = of_kind(records, "allocator")
    assert allocator.stats[0].device == 4294967296
    assert of_kind(records, "run")[0].config == {"learning_rate": 0.0002}


def test_surogate_pretty_printed_objects_and_a_one_line_array():
    session, records = ingest((SUROGATE_PRETTY + SUROGATE_PRETTY.replace('"step": 100', '"step": 101')).split("\n"))
    assert session.format == "surogate"
    assert [(m.step, m.load_imbalance) for m in of_kind(records, "moe")] == [(100, 1.45), (101, 1.45)]
    one_line = json.dumps([{"log": "step", "step": s, "loss": float("nan") if s == 2 else 1.0}
                           for s in (1, 2, 3)])  # NaN as JSON's NaN constant
    _, records = ingest([one_line])
    steps = of_kind(records, "step")
    assert [s.step for s in steps] == [1, 2, 3] and math.isnan(steps[1].loss)


def test_trainmon_dry_run_and_log_file_read_back_as_the_same_records():
    _, original = ingest(raw_lines("nanogpt-*nan-loss*.log"))
    printed = io.BytesIO()
    dry_run = _DryRun(printed)
    for record in original:
        dry_run(record)
    session, again = ingest(printed.getvalue().decode().split("\n"))
    assert session.format == "surogate"
    assert [(r.kind, getattr(r, "step", None)) for r in again if r.kind != "run"] == \
        [(r.kind, getattr(r, "step", None)) for r in original if r.kind != "run"]
    nan_step = by_step(again, "step")[425]
    assert math.isnan(nan_step.loss) and nan_step.duration_ms == 1440.31
    assert by_step(again, "step")[0].step_tokens == 512


def test_a_record_cut_off_mid_line_loses_only_itself():
    lines = ['{"log": "step", "step": 1, "loss": 2.5}', '{"log": "step", "step": 2, "lo',
             '{"log": "step", "step": 3, "loss": 2.25}']
    _, records = ingest(lines)
    assert [(s.step, s.loss) for s in of_kind(records, "step")] == [(1, 2.5), (3, 2.25)]


def test_trainmon_log_file_lines(tmp_path):
    _, original = ingest(raw_lines("torchtitan-moe-gate*duplicate-rank*.log"))
    path = tmp_path / "trainmon.jsonl"
    log_file = JsonLogFile(str(path))
    for record in original:
        log_file(record)
    log_file.close()
    session, again = ingest(path.read_text().split("\n"))
    assert session.format == "surogate"
    assert [(s.step, s.loss, s.norm) for s in of_kind(again, "step")] == \
        [(4, 7.62585, 26.625), (5, 7.07623, 46.5)]


# -- odd input -------------------------------------------------------------------------

ODD = ["", "{", "}", "[", "{'loss': }", "{'loss': 'x'}", "iter x: loss", "step: 1  loss: abc",
       "Epoch 0: : 5/0 [, global_step=e]", "Training epoch 0, iteration 1/0 | global_step: -",
       '{"log": "step", "step": -1, "loss": "nan"}', '{"log": "step"', '[{"log": 5}]',
       "tokens per iteration will be: ,", "Total optimization steps = ,", "\x00\xff" * 50,
       '{"log": "run", "event": "start", "config": 5}', "  {" * 10_000]


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "megatron"])
def test_odd_lines_never_raise(name):
    parser = FORMATS[name]()
    for text in ODD:
        parser.feed(split_line(text))
    parser.flush()
