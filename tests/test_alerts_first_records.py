"""Evidence from the first records: a follow that starts mid-run, a backfilled excerpt or a
restarted engine has no baseline of the run's own, and the rules judge what there is (the
clipping threshold, the halvings a skipped step implies, what a log's missing value means),
while a healthy fresh or resumed start stays quiet. In memory: synthetic runs
(alerts_support) and real corpus logs through the ingest parsers."""

from __future__ import annotations

import re
from datetime import datetime, timezone

from trainmon.schemas import RunRecord

from .alerts_support import engine_with, firing, process_records, synthetic_run
from trainmon.ingest.reader import read_file

from .ingest_support import LOGS, ingest, raw_lines
from .test_ingest_conventions import QWEN, without_loss_at

T0 = 1.7e9


def second_half(name: str) -> list[str]:
    """A corpus log from its middle line on, as the alert-quality benchmark cuts it."""
    lines = list(read_file(LOGS / name))
    return lines[len(lines) // 2:]


def rules_fired(records, **settings) -> list[tuple[str, int]]:
    return [(a.rule, a.step) for a in firing(process_records(engine_with(**settings), records))]


def norms(values: dict[int, float]):
    """A mutation setting the grad norm at some steps."""
    def mutate(s, r, step, gpu, moe):
        if s in values:
            step["norm"] = values[s]
    return mutate


def resumed(first_step: int, steps: int, **kw):
    """The later part of a run: no run start, its first record at ``first_step``."""
    return synthetic_run("later", t0=T0, first_step=first_step, steps=steps, **kw)


def with_config(records, **config):
    start = RunRecord(run_id=records[0].run_id, rank=0, world_size=1, host="node0", event="start",
                      time=datetime.fromtimestamp(T0, timezone.utc), event_id="start", config=config)
    return [start, *records]


# -- grad norm against the clipping threshold -------------------------------------------------


def test_first_record_of_a_follow_two_orders_beyond_clip_fires_at_once():
    """Read from step 500 on: its first norm, 150, is 150x the default threshold 1.0 with
    no earlier norm to compare (grad_spike needs one): fires on that record."""
    records = resumed(500, 520, mutate=norms({500: 150.0}))
    assert rules_fired(records) == [("grad_norm_beyond_clip", 500)]


def test_a_fresh_runs_first_steps_and_a_run_habitually_that_high_are_quiet():
    fresh = synthetic_run("fresh", t0=T0, steps=20, mutate=norms({0: 150.0, 1: 120.0, 2: 90.0}))
    assert rules_fired(fresh) == []
    # Three earlier norms of 60 make the run's own scale: 150 after them is no news (and
    # 2.5x the median is no grad_spike either).
    habitual = resumed(500, 520, mutate=lambda s, r, step, *_: step.update(norm=150.0 if s == 503 else 60.0 + s % 3))
    assert rules_fired(habitual) == []


def test_three_orders_beyond_clip_fire_whatever_came_before():
    """A run habitually at 120-140 whose config says clip_grad 1.0: 1800 is still 1800x
    clip. With the threshold only assumed, 1800 must also be 2x the run's own level (it is,
    13x); a run whose own level is 1e5 does not use the default and stays quiet."""
    records = resumed(500, 520, mutate=lambda s, r, step, *_: step.update(
        norm=1800.0 if s == 510 else 120.0 + s % 3 * 10))
    assert ("grad_norm_beyond_clip", 510) in rules_fired(with_config(records, clip_grad=1.0))
    assert ("grad_norm_beyond_clip", 510) in rules_fired(records)
    big = synthetic_run("big", t0=T0, steps=40, mutate=lambda s, r, step, *_: step.update(norm=1e5 + s))
    assert rules_fired(big) == []


def test_the_threshold_comes_from_the_runs_config():
    """The run record's clip_grad: 10 makes 150 only 15x; 0 turns clipping off."""
    records = resumed(500, 520, mutate=norms({500: 150.0}))
    assert rules_fired(with_config(records, clip_grad=0.1)) == [("grad_norm_beyond_clip", 500)]
    assert rules_fired(with_config(records, clip_grad=10.0)) == []
    assert rules_fired(with_config(records, max_grad_norm=0.0)) == []
    assert rules_fired(records, grad_norm_beyond_clip_clip=10.0) == []  # or from the settings


def test_real_logs_read_from_their_middle():
    """ms-swift's epoch tail from its middle line has one record left, iteration 294's
    109.7: two orders beyond the default threshold, no earlier norm."""
    _, records = ingest(second_half("hf-trainer-swift-gemma4-full-epoch-tail.log"))
    assert ("grad_norm_beyond_clip", 294) in rules_fired(records)


def test_qwen_whole_log_fires_at_the_three_spikes_only():
    """Whole (the log prints no arguments: the default 1.0 assumed): 1802 (6), 2908 (7),
    1002 (10) are over 1000x and over 2x the run's median (430); 894 at iteration 1 and the
    54-625 elsewhere are below 1000x."""
    _, records = ingest(raw_lines(QWEN))
    fired = [s for rule, s in rules_fired(records) if rule == "grad_norm_beyond_clip"]
    assert fired == [6, 10]  # 6-7 one incident


# -- fp16 loss scale: an overflow cascade entered in the middle -------------------------------


def test_a_follow_that_starts_inside_an_overflow_cascade_sees_it():
    """DeepSpeed's OVERFLOW lines from the middle of the excerpt: reducing to 8 (380), 4,
    2 (382). The first ran at 16: three halvings within the window by 382."""
    _, records = ingest(second_half("hf-trainer-deepspeed-fp16-overflow-loss-scale-collapse.log"))
    assert ("loss_scale_collapse", 382) in rules_fired(records)


# -- a value the log leaves out --------------------------------------------------------------


def test_a_megatron_line_without_its_loss_is_a_nan_alert():
    """Iteration 10 printed without ``lm loss`` (its average was NaN) and 0 skipped: the
    non-finite rule fires at 10; as printed, the run has no NaN."""
    lines = without_loss_at(raw_lines(QWEN), 10)
    _, records = ingest(lines)
    assert ("non_finite", 10) in rules_fired(records)
    _, untouched = ingest(raw_lines(QWEN))
    assert not [s for rule, s in rules_fired(untouched) if rule == "non_finite"]
    assert not any(re.search(r"iteration +10/.*lm loss", line) for line in lines)


def test_an_overflow_at_the_floor_fires_even_while_the_scaler_calibrates():
    """``Attempted loss scale: 1, reducing to 1`` at step 98 (of transformers#14531): the
    scaler has nowhere to go, so the calibration's grace (100 iterations) does not apply."""
    from .test_ingest_conventions import FLOOR

    _, records = ingest([FLOOR], fmt="hf-trainer")
    assert ("loss_scale_collapse", 98) in rules_fired(records)


def test_the_hf_trainers_max_grad_norm_is_the_threshold():
    """A follow's first dict at step 500 with grad_norm 45: 45x the default 1.0 is quiet,
    150x the run's printed ``max_grad_norm=0.3`` fires."""
    from .test_ingest_conventions import BAR

    first = BAR.format(n=500) + "{'loss': 1.2, 'grad_norm': 45.0, 'epoch': 0.1}"
    _, records = ingest([first], fmt="hf-trainer")
    assert rules_fired(records) == []
    _, records = ingest(["max_grad_norm=0.3,", first], fmt="hf-trainer")
    assert rules_fired(records) == [("grad_norm_beyond_clip", 500)]


# -- the training loss against the latest eval -------------------------------------------------


def test_a_resumed_run_whose_loss_blew_up_after_its_first_eval_fires_on_its_second_record():
    """Read from step 500: an eval at 500 (loss ~2.1), then the training loss at 6 from 501:
    no history of training losses, but 3x the eval the model just had."""
    blown = resumed(500, 520, eval_every=500, mutate=lambda s, r, step, *_: step.update(loss=6.0) if s > 500 else None)
    assert ("train_loss_above_eval", 502) in rules_fired(blown)
    healthy = resumed(500, 520, eval_every=5)
    assert rules_fired(healthy) == []


# -- a jump between two logged records, against the logging interval ------------------------


def every(k: int, records):
    """The step records of every k-th step (a job that logs every k steps) and the rest."""
    return [r for r in records if r.kind != "step" or r.step % k == 0]


def test_a_jump_between_two_interval_averages_fires_from_the_second_record_a_follow_sees():
    """Logged every 100 steps (Megatron's interval averages), read from step 1000: the loss
    goes 2.0 -> 2.3 (+15 %) between the first two records: a level change for 100-step
    averages (limit +10 %), and loss_spike has no baseline yet. The same +15 % between two
    consecutive single steps is noise (limit +100 %)."""
    def jump(s, r, step, *_):
        step["loss"] = 2.0 + 0.001 * (s % 7) + (0.3 if s >= 1100 else 0.0)

    averaged = every(100, resumed(1000, 1500, mutate=jump))
    assert rules_fired(averaged) == [("loss_jump", 1100)]
    per_step = resumed(1095, 1110, mutate=jump)
    assert rules_fired(per_step) == []


def test_a_fresh_runs_bouncing_loss_is_quiet():
    """Steps 0-99 of a fresh run: the loss may bounce up between records (warm-up)."""
    bouncing = every(10, synthetic_run("fresh", t0=T0, steps=100, mutate=lambda s, r, step, *_: step.update(
        loss=8.0 - s * 0.05 + (1.5 if s == 40 else 0.0))))
    assert [rule for rule, _ in rules_fired(bouncing) if rule == "loss_jump"] == []


# -- a fresh run's warm-up is no baseline ----------------------------------------------------------


def test_the_norms_of_the_lr_warm_up_leave_the_grad_spike_baseline():
    """The gemma-4-26B MoE fine-tune: norms 220, 52.5, 308 while the learning rate warms up
    (3 steps), 7-42 after, then 140 (9), 177 (12), 142 (18). Against a baseline that kept
    the warm-up's norms none was a spike; against the norms after it each is, each its
    own alert (no cooldown between spikes)."""
    _, records = ingest(raw_lines("hf-trainer-ms-swift-gemma4-26b-a4b-moe-8gpu-fsdp2-gradnorm-spikes.log"))
    fired = [s for rule, s in rules_fired(records) if rule == "grad_spike"]
    assert fired[:3] == [9, 12, 18]
    without_lr = [r.model_copy(update={"lr": None}) if r.kind == "step" else r for r in records]
    assert [s for rule, s in rules_fired(without_lr) if rule == "grad_spike"][:1] != [9]
