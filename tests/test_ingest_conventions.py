"""What a framework's log means by leaving a value out, or by printing a stand-in for one,
read from its source (quoted in the parser) and checked on real corpus logs
(tests/data/logs, PROVENANCE.md). Pure, in memory: no broker."""

from __future__ import annotations

import math
import re

from .ingest_support import by_step, ingest, of_kind, raw_lines

QWEN = "megatron-deepspeed-qwen25-7b-finetune-gradnorm.log"
LM_LOSS = re.compile(r" lm loss: [^|]*\|")


def without_loss_at(lines: list[str], iteration: int, skipped: int | None = None) -> list[str]:
    """The log with iteration ``iteration``'s line printed as Megatron prints it when the
    interval's loss average is not >= 0: without its ``lm loss`` field (and, with ``skipped``,
    saying that many iterations were skipped)."""
    out = []
    for line in lines:
        if re.search(rf"\biteration +{iteration}/", line):
            assert LM_LOSS.search(line), line
            line = LM_LOSS.sub("", line)
            if skipped is not None:
                line = re.sub(r"number of skipped iterations: +\d+", f"number of skipped iterations: {skipped}", line)
        out.append(line)
    return out


# -- Megatron: "if avg >= 0.0: log_string += ' {}: {:.6E} |'.format(key, avg)" ---------


def test_megatron_line_without_the_loss_earlier_lines_had_is_a_nan_loss():
    """Iteration 10 of the Qwen2.5 finetune printed without its ``lm loss`` (what Megatron
    prints for a NaN average) while 0 iterations were skipped: a NaN loss, not "not
    logged"; the lines around it keep theirs."""
    _, records = ingest(without_loss_at(raw_lines(QWEN), 10))
    steps = by_step(records, "step")
    assert math.isnan(steps[10].loss) and steps[10].skipped == 0
    assert steps[9].loss == 6.484428 and steps[11].loss == 6.00275
    _, untouched = ingest(raw_lines(QWEN))
    assert by_step(untouched, "step")[10].loss == 6.073902


def test_megatron_line_without_loss_because_every_iteration_was_skipped_has_none():
    """The same line saying its one iteration (lines every iteration) was skipped: the loss
    was not measured, so the record has none, and the skipped count says why."""
    _, records = ingest(without_loss_at(raw_lines(QWEN), 10, skipped=1))
    step = by_step(records, "step")[10]
    assert step.loss is None and step.skipped == 1


def test_megatron_fp16_warmup_intervals_all_skipped_carry_no_loss():
    """The real fp16 start: iterations 5 and 10 each say ``number of skipped iterations: 5``
    of a 5-iteration interval, and print no ``lm loss``: skipped, not NaN."""
    _, records = ingest(raw_lines("megatron-lm-gpt2-2.6b-v100-fp16-loss-scale-warmup.log"))
    steps = of_kind(records, "step")
    assert [(s.step, s.skipped, s.loss) for s in steps] == [(5, 5, None), (10, 5, None)]


def test_megatron_first_line_without_any_loss_and_nothing_skipped_is_a_nan_loss():
    """Megatron-Bridge's iteration 5 (a log read from there on, no earlier line): no loss
    field, ``grad norm: nan``, ``number of skipped iterations: 0``: the language-model loss
    every Megatron loop reports averaged to NaN."""
    _, records = ingest(raw_lines("megatron-core-bridge-dsv4-fp8mx-gradnorm-nan-wrapped.log"))
    (step,) = of_kind(records, "step")
    assert math.isnan(step.loss) and math.isnan(step.norm) and step.skipped == 0


# epfLLM/Megatron-LLM#34 (Falcon-40B fine-tune, bf16, NaN losses from ~3300): iteration 3633
# prints no loss with 0 skipped; after the PR's NaN check, 3634 skips its one iteration.
MEGATRON_LLM_NAN = [
    " iteration     3633/    8000 | consumed samples:       232512 | elapsed time per iteration (ms): 6956.6 | "
    "learning rate: 6.245E-06 | global batch size:    64 | loss scale: 1.0 | grad norm: 0.794 | "
    "number of skipped iterations:   0 | number of nan iterations:   0 |",
    "***WARNING*** Bad grad_norm detected (grad_norm=nan)",
    " iteration     3634/    8000 | consumed samples:       232576 | elapsed time per iteration (ms): 8295.0 | "
    "learning rate: 6.245E-06 | global batch size:    64 | loss scale: 1.0 | number of skipped iterations:   1 |",
]
# deepspeedai/Megatron-DeepSpeed#434: "the only way we can judge this issue [a NaN] is no lm
# loss print and the number of nan iterations is still 0".
MEGATRON_DEEPSPEED_NAN = (
    " iteration        9/      10 | consumed samples:          108 | consumed tokens:       442368 | "
    "elapsed time per iteration (ms): 1979.2 | learning rate: 4.219E-07 | global batch size:    12 | "
    "loss scale: 1.0 | actual seqlen:  4096 | number of skipped iterations:   0 | number of nan iterations:   0 | "
    "samples per second: 6.063 | tokens per gpu per second (tgs): 2069.506 | TFLOPs: 127.00 |")


def test_megatron_issue_lines_without_loss_are_nan_unless_skipped():
    """The lines the issues report NaN losses with: a NaN loss where nothing was skipped,
    none where the line's one iteration was."""
    _, records = ingest(MEGATRON_LLM_NAN)
    nan_line, skipped_line = of_kind(records, "step")
    assert nan_line.step == 3633 and math.isnan(nan_line.loss) and nan_line.norm == 0.794
    assert (skipped_line.step, skipped_line.skipped, skipped_line.loss) == (3634, 1, None)
    _, records = ingest([MEGATRON_DEEPSPEED_NAN])
    (step,) = of_kind(records, "step")
    assert step.step == 9 and math.isnan(step.loss) and step.nan_iterations == 0


# -- HF Trainer: logging_nan_inf_filter ------------------------------------------------------


def test_hf_trainer_zero_loss_beside_a_nan_grad_norm_is_a_nan_loss():
    """ModernBERT: ``'loss': 0.0, 'grad_norm': nan`` twice after ``'loss': 0.2051,
    'grad_norm': nan``: the Trainer's NaN filter averaged NaN steps into 0."""
    _, records = ingest(raw_lines("hf-trainer-modernbert*.log"))
    losses = [s.loss for s in of_kind(records, "step")]
    assert losses[0] == 0.2051 and all(math.isnan(x) for x in losses[1:]) and len(losses) == 3


def test_hf_trainer_zero_loss_beside_a_finite_grad_norm_stays_zero():
    """LLaMA-Factory: ``{'loss': 0.0, 'grad_norm': 1.4142135381698608, ...}``: finite
    gradients, so a loss that really is 0 (every label masked), for the zero_loss rule."""
    _, records = ingest(raw_lines("hf-trainer-llamafactory-zero-loss-line-numbered.log"))
    (step,) = of_kind(records, "step")
    assert step.loss == 0.0 and step.norm == 1.4142135381698608


# -- nanoGPT: no end-of-training line, but wandb's exit footer ---------------------------------


def test_nanogpt_wandb_exit_footer_ends_the_run():
    """The TinyStories run's last lines are wandb's footer (``wandb: Find logs at: ...``),
    printed at process exit: the run ended, successfully, also for a reader that never saw
    its config (``max_iters``)."""
    lines = raw_lines("nanogpt-tinystories*.log")
    for tail in (lines, lines[len(lines) // 2:]):
        _, records = ingest(tail)
        end = of_kind(records, "run")[-1]
        assert (end.event, end.status) == ("end", "success")
    _, cut = ingest([line for line in lines if not line.startswith("wandb: Find logs at:")])
    assert [r.event for r in of_kind(cut, "run")] == ["start"]


# -- DeepSpeed's fp16 loss scaler (loss_scaler.py update_scale) ---------------------------------

# A bar as the HF Trainer draws it before DeepSpeed's line (the corpus log's), and the
# overflow lines of deepspeedai/DeepSpeed#5779 (hysteresis) and huggingface/transformers#14531
# (pre-2021 "[deepscale]" prefix, at the floor).
BAR = " 14%|█▍        | {n}/2724 [14:02:33<86:01:24, 132.12s/it]"
HYSTERESIS = ("[2024-07-17 19:44:06,829] [INFO] [loss_scaler.py:190:update_scale] [deepspeed] OVERFLOW! "
              "Rank 0 Skipping step. Attempted loss scale: 65536, but hysteresis is 2. Reducing hysteresis to 1")
REDUCING = ("[2024-07-17 19:44:06,945] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! "
            "Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768")
FLOOR = ("  0%|▋       | 98/24128 [00:40<2:40:10,  2.50it/s][2021-11-27 00:36:54,800] [INFO] "
         "[stage2.py:1628:step] [deepscale] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1, reducing to 1")


def test_deepspeed_overflow_absorbed_by_hysteresis_is_a_skipped_step_at_the_same_scale():
    _, records = ingest([BAR.format(n=5) + HYSTERESIS, BAR.format(n=6) + REDUCING], fmt="hf-trainer")
    assert [(s.step, s.skipped, s.loss_scale) for s in of_kind(records, "step")] == [
        (5, 1, 65536.0), (6, 1, 32768.0)]


def test_deepscale_overflow_at_the_floor_is_a_skipped_step_at_scale_one():
    _, records = ingest([FLOOR], fmt="hf-trainer")
    assert [(s.step, s.skipped, s.loss_scale) for s in of_kind(records, "step")] == [(98, 1, 1.0)]


def test_hf_trainer_max_grad_norm_goes_into_the_runs_config():
    """The TrainingArguments repr prints ``max_grad_norm=0.3,`` on a line of its own."""
    _, records = ingest(["max_grad_norm=0.3,", "{'loss': 1.2, 'grad_norm': 0.9, 'epoch': 0.1}"])
    (start,) = [r for r in of_kind(records, "run") if r.event == "start"]
    assert start.config["max_grad_norm"] == 0.3


# -- torchtitan: a rank without the pipeline's last stage logs loss -1.0 ------------------------

# pytorch/torchtitan#1232 ("PP report loss=-1"): rank 0 of a 16-stage pipeline.
PP_FIRST_STAGE = [
    "[rank0]:[titan] 2025-05-28 21:13:37,816 - root - INFO - step:  1  loss: -1.0000  memory: 36.90GiB(46.63%)  tps: 4  tflops: 0.90  mfu: 0.29%",
    "[rank0]:[titan] 2025-05-28 21:14:39,054 - root - INFO - step:  2  loss: -1.0000  memory: 42.78GiB(54.06%)  tps: 8  tflops: 1.81  mfu: 0.58%",
]


def test_torchtitan_loss_minus_one_is_no_loss():
    """A stand-in, not a loss: the step records keep tps/tflops and carry no loss (a frozen
    or negative loss would otherwise be reported on every pipeline-parallel run)."""
    _, records = ingest(PP_FIRST_STAGE)
    steps = of_kind(records, "step")
    assert [(s.step, s.loss, s.tflops_per_gpu) for s in steps] == [(1, None, 0.9), (2, None, 1.81)]


def test_torchtitan_negative_validation_loss_is_no_eval():
    """validate.py sums -1.0 per step on such a rank, then divides by the tokens: a small
    negative loss, which a cross-entropy never is. A real validation line still reads."""
    from trainmon.ingest.formats.torchtitan import TorchTitanParser
    from trainmon.ingest.lines import split_line

    def evals(text):
        return [p for p in TorchTitanParser().feed(split_line(text)) if p.kind == "eval"]

    assert evals("[titan] 2025-06-01 10:00:00,000 - root - INFO - validate step: 20  loss: -0.0001  memory: 1.00GiB(1.00%)  tps: 100") == []
    (real,) = evals("[titan] 2025-06-01 10:00:00,000 - root - INFO - validate step: 20  loss:  9.3507  memory: 69.81GiB(88.17%)  tps: 74,600")
    assert real.fields["loss"] == 9.3507


# -- HF Trainer: tqdm bars and dicts ----------------------------------------------------------

# 2U1/Qwen-VL-Series-Finetune#10: the bar, the dict (tqdm.write), the bar's redraw, the next
# update, the next dict.
QWEN_VL = [
    "  0%|          | 1/666 [00:22<4:08:53, 22.46s/it]",
    "                                                 ",
    "{'loss': 1.0446, 'grad_norm': nan, 'learning_rate': 1.4925373134328357e-08, 'epoch': 0.0}",
    "",
    "  0%|          | 1/666 [00:24<4:08:53, 22.46s/it]",
    "  0%|          | 2/666 [00:40<3:41:45, 20.04s/it]",
    "                                                 ",
    "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 2.9850746268656714e-08, 'epoch': 0.01}",
]


def test_hf_trainer_dict_before_the_bar_caught_up_is_the_next_logging_step():
    """As printed: steps 1 and 2, the second loss NaN (0.0 beside grad_norm nan). Without
    the update line of step 2 (tqdm draws at most every mininterval; a terminal copy keeps
    what was on screen), the last bar before the second dict is step 1's redraw: the
    Trainer logs a step once, so that dict is the next logging step, not step 1 again."""
    _, records = ingest(QWEN_VL, fmt="hf-trainer")
    steps = of_kind(records, "step")
    assert [s.step for s in steps] == [1, 2] and steps[0].loss == 1.0446 and math.isnan(steps[1].loss)
    lagging = [line for line in QWEN_VL if "2/666" not in line]
    _, records = ingest(lagging, fmt="hf-trainer")
    assert [s.step for s in of_kind(records, "step")] == [1, 2]


# hiyouga/LlamaFactory#6286: LLaMA-Factory's rounded copy of each dict through its logger,
# then the Trainer's own.
LLAMAFACTORY_COPIES = [
    "[INFO|2024-12-08 01:09:59] llamafactory.train.callbacks:157 >> {'loss': 0.0000, 'learning_rate': 4.9985e-05, 'epoch': 0.03}",
    "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 4.998452110450943e-05, 'epoch': 0.03}",
    "  1%|█▍        | 75/6249 [08:38<11:33:05,  6.74s/it][INFO|2024-12-08 01:10:34] llamafactory.train.callbacks:157 >> {'loss': 0.0000, 'learning_rate': 4.9982e-05, 'epoch': 0.04}",
    "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 4.998223113110496e-05, 'epoch': 0.04}",
    "  1%|█▌        | 80/6249 [09:17<13:46:10,  8.04s/it][INFO|2024-12-08 01:11:13] llamafactory.train.callbacks:157 >> {'loss': 0.0000, 'learning_rate': 4.9980e-05, 'epoch': 0.04}",
    "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 4.9979783305842495e-05, 'epoch': 0.04}",
]


def test_llamafactory_copy_of_the_dict_is_skipped():
    """One step record per logging step, from the Trainer's dict (its NaN grad norm makes
    the 0.0 a NaN loss), none from the copy (rounded, without grad_norm: it would be a
    zero loss)."""
    _, records = ingest(LLAMAFACTORY_COPIES, fmt="hf-trainer")
    steps = of_kind(records, "step")
    assert len(steps) == 3 and [s.step for s in steps[1:]] == [75, 80]
    assert all(math.isnan(s.loss) and math.isnan(s.norm) for s in steps)
