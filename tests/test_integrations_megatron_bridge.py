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
        "on_train_start", "on_train_step_end", "on_eval_end", "on_train_end"}

    weights = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([weights], lr=3e-4)
    state = SimpleNamespace(cfg=ConfigContainer(), train_state=SimpleNamespace(step=0, consumed_train_samples=0),
                            timers=Timers())

    def context(**fields):
        return bridge.CallbackContext(state=state, model=[], user_state=manager.user_state, **fields)

    manager.fire("on_train_start", context(optimizer=optimizer))
    for it in range(10):
        loss = 5.0 - it * 0.1
        state.train_state.consumed_train_samples += 32
        manager.fire("on_train_step_end", context(
            optimizer=optimizer, loss_dict={"lm loss": torch.tensor(loss), "load_balancing_loss": torch.tensor(1.01),
                                            "mtp_1 loss": torch.tensor(loss + 0.2)},
            grad_norm=1.5, skipped_iter=it == 7))
        state.train_state.step += 1  # as train.py does after the callback
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
