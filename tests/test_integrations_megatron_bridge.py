"""The Megatron-Bridge callback against the installed package's real callback system.

Bridge's package cannot be imported on a CPU machine (``megatron.bridge`` imports
Transformer Engine at import time), so bootstrap installs ``megatron-bridge`` without its
dependencies and this test loads the package's own ``megatron/bridge/training/callbacks.py``
(which imports nothing at run time): the real ``CallbackManager`` registers the callback
with ``add()`` and fires it with real ``CallbackContext`` objects, the way
``megatron.bridge.training.train`` and ``eval`` do. What the test provides itself, since a
real ``GlobalState`` needs Megatron-Core and a GPU: ``state.cfg`` (train_iters,
global_batch_size, seq_length, as dataclasses), ``state.train_state`` (step, consumed
samples), ``state.timers`` (two named timers), the optimizer (a real torch AdamW), and
tensors for ``loss_dict`` / ``total_loss_dict`` as Bridge's reduction leaves them."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from trainmon.integrations.megatron_bridge import TrainmonCallback

from .conftest import read_records


def bridge_callbacks():
    try:
        dist = importlib.metadata.distribution("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("megatron-bridge is not installed: scripts/bootstrap.sh installs it (--no-deps)")
    path = dist.locate_file("megatron/bridge/training/callbacks.py")
    spec = importlib.util.spec_from_file_location("bridge_callbacks", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass
class TrainConfig:
    train_iters: int = 10
    global_batch_size: int = 32


@dataclass
class ModelConfig:
    seq_length: int = 2048
    num_moe_experts: int = 8


@dataclass
class ConfigContainer:
    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)


class Timers:
    def __call__(self, name):
        return SimpleNamespace(elapsed=lambda reset=True: {"forward-backward": 0.25, "optimizer": 0.05}[name])


def test_bridge_fires_the_callback_and_the_records_arrive(make_producer, bootstrap, topic_prefix):
    bridge = bridge_callbacks()
    producer = make_producer(run_id="bridge-run")
    manager = bridge.CallbackManager()
    manager.add(TrainmonCallback(producer, timers=("forward-backward", "optimizer")))
    assert {e for e in bridge.VALID_EVENTS if manager.has_callbacks(e)} == {
        "on_train_start", "on_train_step_start", "on_train_step_end", "on_eval_end", "on_train_end"}

    weights = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([weights], lr=3e-4)
    state = SimpleNamespace(cfg=ConfigContainer(), train_state=SimpleNamespace(step=0, consumed_train_samples=0),
                            timers=Timers())

    def context(**fields):
        return bridge.CallbackContext(state=state, model=[], user_state=manager.user_state, **fields)

    manager.fire("on_train_start", context(optimizer=optimizer))
    for it in range(10):
        loss = 5.0 - it * 0.1
        manager.fire("on_train_step_start", context(optimizer=optimizer))
        manager.fire("on_train_step_end", context(
            optimizer=optimizer, loss_dict={"lm loss": torch.tensor(loss), "load_balancing_loss": torch.tensor(1.01),
                                            "mtp_1 loss": torch.tensor(loss + 0.2)},
            grad_norm=1.5, skipped_iter=it == 7))
        state.train_state.step += 1  # as train.py does after the callback
        state.train_state.consumed_train_samples += 32
        if state.train_state.step % 5 == 0:
            manager.fire("on_eval_end", context(total_loss_dict={"lm loss": torch.tensor(loss + 0.1)}))
    manager.fire("on_train_end", context(optimizer=optimizer))
    assert producer.flush(30) and producer.rejected == {}

    steps = sorted(read_records(bootstrap, topic_prefix, "step", 10), key=lambda r: r.step)
    assert [s.step for s in steps] == list(range(1, 11))  # Megatron's iteration numbers
    first = steps[0]
    assert first.loss == pytest.approx(5.0) and first.norm == 1.5 and first.lr == pytest.approx(3e-4)
    assert first.losses == {"load_balancing_loss": pytest.approx(1.01), "mtp_1 loss": pytest.approx(5.2)}
    assert first.total_steps == 10 and first.global_batch_size == 32 and first.step_tokens == 32 * 2048
    assert first.consumed_samples == 32 and first.timers == {"forward-backward": 250.0, "optimizer": 50.0}
    assert [s.skipped for s in steps] == [0] * 7 + [1] + [0] * 2
    assert first.loss_scale is None  # a torch optimizer has no loss scale (bf16 / fp32)
    moe = read_records(bootstrap, topic_prefix, "moe", 10)
    assert [round(m.aux_loss, 4) for m in moe] == [1.01] * 10
    evals = sorted(read_records(bootstrap, topic_prefix, "eval", 2), key=lambda r: r.step)
    assert [(e.step, round(e.loss, 3)) for e in evals] == [(5, 4.7), (10, 4.2)]
    runs = read_records(bootstrap, topic_prefix, "run", 2)
    start = next(r for r in runs if r.event == "start")
    assert start.config["train"] == {"train_iters": 10, "global_batch_size": 32}
    assert [r.status for r in runs if r.event == "end"] == ["success"]


# -- without a broker: what the callback hands the producer -----------------------------

class Recorder:
    """Stands in for the Producer: the calls the callback makes, in order."""

    def __init__(self):
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))

    def steps(self) -> list[dict]:
        return [{"step": args[0], **kwargs} for name, args, kwargs in self.calls if name == "log_step"]


class MegatronTimer:
    """megatron.core.timers.Timer's bookkeeping, with a clock the test moves: elapsed() since
    the last reset(), active_time() since the timer was made."""

    def __init__(self):
        self._elapsed = self._active_time = 0.0

    def run(self, seconds: float) -> None:
        self._elapsed += seconds
        self._active_time += seconds

    def reset(self) -> None:
        self._elapsed = 0.0

    def elapsed(self, reset=True, barrier=False):
        value = self._elapsed
        if reset:
            self.reset()
        return value

    def active_time(self):
        return self._active_time


class DummyTimer:
    def elapsed(self, reset=True, barrier=False):
        raise Exception("dummy timer should not be used to calculate elapsed time")  # Megatron's words


class MegatronTimers:
    """megatron.core.timers.Timers: timers(name) makes a timer at log level 2 when none is
    given, and hands back a DummyTimer above the run's timing_log_level (default 0)."""

    def __init__(self, log_level: int = 0):
        self._log_level, self._timers, self._log_levels = log_level, {}, {}

    def __call__(self, name, log_level=None):
        if name in self._timers:
            assert log_level is None or log_level == self._log_levels[name], "log level does not match"
            return self._timers[name]
        log_level = 2 if log_level is None else log_level
        if log_level > self._log_level:
            return DummyTimer()
        self._timers[name] = MegatronTimer()
        self._log_levels[name] = log_level
        return self._timers[name]

    def log(self, names, normalizer=1.0, reset=True):  # training_log, at the log interval
        for name in names:
            if name in self._timers and reset:
                self._timers[name].reset()


def train(callback: TrainmonCallback, state, steps: int, *, between=lambda step: None, during=lambda: None):
    """Bridge's loop around the callback (megatron/bridge/training/train.py): the step's
    events, then the step count and the consumed samples advanced, then ``between(step)``
    (``between(0)``: after on_train_start)."""
    bridge = bridge_callbacks()
    manager = bridge.CallbackManager()
    manager.add(callback)

    def context(**fields):
        return bridge.CallbackContext(state=state, model=[], user_state=manager.user_state, **fields)

    manager.fire("on_train_start", context())
    between(0)
    for _ in range(steps):
        manager.fire("on_train_step_start", context())
        during()
        manager.fire("on_train_step_end", context(loss_dict={"lm loss": torch.tensor(2.0)}, grad_norm=1.0,
                                                  skipped_iter=False))
        state.train_state.step += 1
        state.train_state.consumed_train_samples += state.cfg.train.global_batch_size
        between(state.train_state.step)
    manager.fire("on_train_end", context())


def test_timers_are_each_step_s_own_though_megatron_resets_them_at_its_log_interval():
    """Megatron's training_log resets its timers every log_interval steps (timers.log): until
    then elapsed() holds every step since. Each step here runs forward-backward 0.25 s and the
    optimizer 0.05 s, with a log interval of 3."""
    timers = MegatronTimers(log_level=1)
    forward_backward, optimizer = timers("forward-backward", log_level=1), timers("optimizer", log_level=1)

    def during():
        forward_backward.run(0.25)
        optimizer.run(0.05)

    state = SimpleNamespace(cfg=ConfigContainer(), train_state=SimpleNamespace(step=0, consumed_train_samples=0),
                            timers=timers)
    producer = Recorder()
    train(TrainmonCallback(producer, timers=("forward-backward", "optimizer")), state, 7,
          during=during, between=lambda step: step % 3 == 0 and timers.log(["forward-backward", "optimizer"]))
    steps = producer.steps()
    assert [s["step"] for s in steps] == list(range(1, 8))
    assert [s["timers"] for s in steps] == [{"forward-backward": pytest.approx(250.0),
                                             "optimizer": pytest.approx(50.0)}] * 7


def test_a_timer_megatron_has_not_made_is_left_alone():
    """Megatron's default timing_log_level is 0: "forward-backward" (level 1) is never made,
    and timers("forward-backward") is a DummyTimer whose elapsed() raises: the step records
    are sent without it. At timing_log_level 2, "save-checkpoint" is made by Megatron's first
    save (at level 0, after step 2 here): trainmon asking for it before must not make it at
    level 2, or Megatron's own call fails its assert, in the training loop."""
    state = SimpleNamespace(cfg=ConfigContainer(), train_state=SimpleNamespace(step=0, consumed_train_samples=0),
                            timers=MegatronTimers(log_level=0))
    producer = Recorder()
    train(TrainmonCallback(producer, timers=("forward-backward",)), state, 3)
    assert [s["step"] for s in producer.steps()] == [1, 2, 3]
    assert all("timers" not in s for s in producer.steps())

    timers = MegatronTimers(log_level=2)

    def between(step):
        if step == 2:
            timers("save-checkpoint", log_level=0).run(30.0)  # train.py's save_checkpoint_and_time

    state = SimpleNamespace(cfg=ConfigContainer(), train_state=SimpleNamespace(step=0, consumed_train_samples=0),
                            timers=timers)
    producer = Recorder()
    train(TrainmonCallback(producer, timers=("save-checkpoint",)), state, 4, between=between)
    assert [s.get("timers") for s in producer.steps()] == [None, None, {"save-checkpoint": pytest.approx(30000.0)},
                                                           {"save-checkpoint": 0.0}]


def test_consumed_samples_include_the_step_s_batch_as_megatron_prints_them():
    """Bridge adds the step's global batch to consumed_train_samples after on_train_step_end;
    Megatron's log line for iteration N counts N batches."""
    state = SimpleNamespace(cfg=ConfigContainer(), train_state=SimpleNamespace(step=0, consumed_train_samples=0))
    producer = Recorder()
    train(TrainmonCallback(producer), state, 3)
    assert [(s["step"], s["consumed_samples"]) for s in producer.steps()] == [(1, 32), (2, 64), (3, 96)]


def test_a_step_s_duration_leaves_out_the_evaluation_and_the_save_before_it(monkeypatch):
    """Each step takes 2 s; after step 2 a 60 s evaluation, after step 3 a 30 s checkpoint
    save (Bridge runs both between a step's end and the next one's start; Megatron's
    interval timer stops for them). Megatron's elapsed time per iteration: 2 s each."""
    from trainmon.integrations import megatron_bridge

    now = [1000.0]
    monkeypatch.setattr(megatron_bridge, "time", SimpleNamespace(monotonic=lambda: now[0]))

    def during():
        now[0] += 2.0

    def between(step):
        now[0] += {0: 45.0, 2: 60.0, 3: 30.0}.get(step, 0.0)  # 0: start-up, not the first step's

    state = SimpleNamespace(cfg=ConfigContainer(), train_state=SimpleNamespace(step=0, consumed_train_samples=0))
    producer = Recorder()
    train(TrainmonCallback(producer), state, 5, during=during, between=between)
    assert [s["duration_ms"] for s in producer.steps()] == [pytest.approx(2000.0)] * 5
