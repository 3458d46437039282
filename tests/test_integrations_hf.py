"""The HF Trainer callback for real: a tiny GPT-2 trained on CPU by the real Trainer, its
records through the real broker into ClickHouse and read back with SQL."""

from __future__ import annotations

import json
import math

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from trainmon.integrations.hf import TrainmonCallback  # noqa: E402

from .clickhouse_service import ClickHouseService  # noqa: E402
from .clickhouse_service import kill_leftover_services  # noqa: E402,F401 (autouse fixture)

SEQ = 16
BATCH = 4
STEPS = 12


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_a_real_trainer_run_lands_its_steps_evals_and_saves_in_clickhouse(
        make_producer, bootstrap, topic_prefix, tmp_path):
    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "ch", tmp_path / "service.log").start()
    producer = make_producer(run_id="hf-run")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, logging_steps=2, eval_strategy="steps",
        eval_steps=6, save_strategy="steps", save_steps=6, per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH, learning_rate=1e-3, report_to="none", use_cpu=True,
        include_num_input_tokens_seen=True, disable_tqdm=True, seed=0, run_name="tiny-gpt2")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData(64, 0),
                                   eval_dataset=TokenData(8, 1), callbacks=[TrainmonCallback(producer)])
    trainer.train()
    assert producer.flush(30)

    run = "run_id = 'hf-run'"
    service.wait_for(f"SELECT count() FROM trainmon.step FINAL WHERE {run}", STEPS // 2)
    steps = service.rows("SELECT step, loss, norm, lr, epoch, total_steps, duration_ms, step_tokens "
                         f"FROM trainmon.step FINAL WHERE {run} ORDER BY step")
    assert [s["step"] for s in steps] == list(range(2, STEPS + 1, 2))  # every logging_steps
    for s in steps:
        assert math.isfinite(s["loss"]) and 0 < s["loss"] < 10
        assert s["norm"] > 0 and 0 < s["lr"] <= 1e-3 and s["total_steps"] == STEPS
        assert s["duration_ms"] > 0 and s["step_tokens"] == BATCH * SEQ
    assert steps[-1]["epoch"] == pytest.approx(STEPS * BATCH / 64)

    service.wait_for(f"SELECT count() FROM trainmon.eval FINAL WHERE {run}", 2)
    evals = service.rows(f"SELECT step, loss, duration_ms FROM trainmon.eval FINAL WHERE {run} ORDER BY step")
    assert [e["step"] for e in evals] == [6, 12]
    assert all(math.isfinite(e["loss"]) and e["duration_ms"] > 0 for e in evals)

    service.wait_for(f"SELECT count() FROM trainmon.checkpoint FINAL WHERE {run}", 2)
    saves = service.rows(f"SELECT step, path, bytes FROM trainmon.checkpoint FINAL WHERE {run} ORDER BY step")
    assert [(c["step"], c["path"].rsplit("/", 1)[1]) for c in saves] == [(6, "checkpoint-6"), (12, "checkpoint-12")]
    assert all(c["bytes"] > 10_000 for c in saves)  # the weights and optimizer state were written

    service.wait_for(f"SELECT count() FROM trainmon.run FINAL WHERE {run}", 2)
    runs = service.rows(f"SELECT event, status, name, config FROM trainmon.run FINAL WHERE {run} ORDER BY time")
    assert [(r["event"], r["status"]) for r in runs][-1] == ("end", "success")
    start = runs[0]
    assert start["event"] == "start" and start["name"] == "tiny-gpt2"
    config = json.loads(start["config"])
    assert config["model"]["n_embd"] == 32 and config["training_args"]["logging_steps"] == 2
    assert service.stop() == 0


def test_a_failing_producer_never_stops_the_trainer(tmp_path, caplog):
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("monitoring is down")

    callback = TrainmonCallback(producer=Broken())
    state = transformers.TrainerState(global_step=2, max_steps=4, epoch=0.5)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    control = transformers.TrainerControl()
    callback.on_train_begin(args, state, control)
    callback.on_log(args, state, control, logs={"loss": 1.0})
    callback.on_train_end(args, state, control)
    assert "on_log failed (training goes on)" in caplog.text
