"""The Lightning logger for real: a tiny model trained on CPU by the real Lightning
Trainer, its records through the real broker into ClickHouse and read back with SQL."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from .clickhouse_service import ClickHouseService  # noqa: E402
from .clickhouse_service import kill_leftover_services  # noqa: E402,F401 (autouse fixture)

STEPS = 12


@pytest.fixture(scope="module")
def lightning():
    """Imported when a test here runs (~3 s), not whenever the suite is collected."""
    return pytest.importorskip("lightning")


def regression(lightning, lr: float = 0.05, hidden: int = 8):
    class Regression(lightning.LightningModule):
        def __init__(self, lr: float, hidden: int):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    return Regression(lr, hidden)


def loader(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def test_a_real_lightning_run_lands_its_steps_and_evals_in_clickhouse(
        lightning, make_producer, bootstrap, topic_prefix, tmp_path):
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    from trainmon.integrations.lightning import TrainmonLogger

    service = ClickHouseService(bootstrap, topic_prefix, tmp_path / "ch", tmp_path / "service.log").start()
    producer = make_producer(run_id="pl-run")
    trainer = lightning.Trainer(
        max_steps=STEPS, log_every_n_steps=2, val_check_interval=6, limit_val_batches=2,
        accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
        logger=TrainmonLogger(producer), default_root_dir=str(tmp_path),
        callbacks=[LearningRateMonitor(logging_interval="step"),
                   ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=6, save_top_k=-1)])
    trainer.fit(regression(lightning), loader(96, 0), loader(16, 1))
    assert producer.flush(30)

    run = "run_id = 'pl-run'"
    service.wait_for(f"SELECT count() FROM trainmon.step FINAL WHERE {run}", STEPS // 2)
    steps = service.rows(f"SELECT step, loss, lr, epoch, duration_ms FROM trainmon.step FINAL WHERE {run} ORDER BY step")
    # Lightning logs at global steps 1, 3, 5, ... (its step count before the increment).
    assert [s["step"] for s in steps] == list(range(1, STEPS, 2))
    for s in steps:
        assert math.isfinite(s["loss"]) and s["loss"] > 0 and s["lr"] == pytest.approx(0.05)
        assert s["epoch"] == 0
    assert all(s["duration_ms"] > 0 for s in steps[1:])

    service.wait_for(f"SELECT count() FROM trainmon.eval FINAL WHERE {run}", 2)
    evals = service.rows(f"SELECT step, loss FROM trainmon.eval FINAL WHERE {run} ORDER BY step")
    assert len(evals) == 2 and all(math.isfinite(e["loss"]) for e in evals)
    assert evals[0]["step"] < evals[1]["step"] <= STEPS

    service.wait_for(f"SELECT count() FROM trainmon.checkpoint FINAL WHERE {run}", 2)
    service.wait_for(f"SELECT count() FROM trainmon.run FINAL WHERE {run}", 2)
    runs = service.rows(f"SELECT event, status, config FROM trainmon.run FINAL WHERE {run} ORDER BY time")
    assert [(r["event"], r["status"]) for r in runs][-1] == ("end", "success")
    assert json.loads(runs[0]["config"]) == {"lr": 0.05, "hidden": 8}
    assert service.stop() == 0


def test_metric_names_map_onto_records(lightning, make_producer):
    from trainmon.integrations.lightning import TrainmonLogger

    sent = []

    class Recorder:
        config = None

        def __getattr__(self, name):
            return lambda *args, **fields: sent.append((name, args, fields)) or True

    logger = TrainmonLogger(Recorder())
    logger.log_metrics({"train/loss": 2.5, "lr-AdamW": 1e-4, "grad_2.0_norm_total": 3.0,
                        "train/aux_loss": 0.1, "accuracy": 0.7, "epoch": 1.0}, step=10)
    logger.log_metrics({"val_loss_epoch": 2.0, "train_loss_epoch": 2.4, "epoch": 1.0}, step=20)
    steps = [s for s in sent if s[0] == "log_step"]
    assert steps == [("log_step", (10,), {"loss": 2.5, "epoch": 1.0, "norm": 3.0, "lr": 1e-4,
                                          "losses": {"train/aux_loss": 0.1}})]
    assert [s for s in sent if s[0] == "log_eval"] == [("log_eval", (20,), {"loss": 2.0, "epoch": 1.0})]


class _StubProducer:
    """The producer calls TrainmonLogger makes, in order."""

    def __init__(self):
        self.config = SimpleNamespace(run_id="pl-stub")
        self.calls: list[str] = []

    def run_start(self, **kw):
        self.calls.append("run_start")

    def log_step(self, step, **kw):
        self.calls.append("log_step")

    def log_eval(self, step, **kw):
        self.calls.append("log_eval")

    def log_checkpoint(self, step, **kw):
        self.calls.append("log_checkpoint")

    def run_end(self, status, **kw):
        self.calls.append("run_end")

    def flush(self, timeout=10.0):
        # A real Producer.flush waits until Kafka has acknowledged every record, up to
        # ``timeout`` (+1 s): with the broker down, that is 11 s of the training loop.
        self.calls.append(f"flush({timeout})")
        return True


def test_lightning_logger_does_not_flush_the_producer_at_every_logged_step(lightning, tmp_path):
    from trainmon.integrations.lightning import TrainmonLogger

    class Model(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, _):
            loss = self.net(batch[0]).pow(2).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 2)), batch_size=4)
    producer = _StubProducer()
    trainer = lightning.Trainer(max_steps=6, log_every_n_steps=1, accelerator="cpu", devices=1,
                                enable_progress_bar=False, enable_model_summary=False,
                                enable_checkpointing=False, logger=TrainmonLogger(producer),
                                default_root_dir=str(tmp_path))
    trainer.fit(Model(), data)
    assert producer.calls.count("log_step") == 6
    # Lightning's LoggerConnector.log_metrics calls logger.save() right after every
    # logger.log_metrics(): a flush there makes every logged step wait for Kafka.
    during_training = producer.calls[:producer.calls.index("run_end")]
    assert not [c for c in during_training if c.startswith("flush")], producer.calls
