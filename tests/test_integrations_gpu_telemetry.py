"""GPU telemetry through the framework callbacks, as W&B's system metrics come with its
callbacks: the real HF Trainer and Lightning Trainer on CPU, with a GPU that NVML and
torch.cuda would show swapped in at the module's seams (CI has no GPU; the real NVML and
torch.cuda paths are checked by scripts/gpu_check.py on one, tests/data/gpu)."""

from __future__ import annotations

import threading
import time

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from trainmon.integrations import gpu_telemetry  # noqa: E402
from trainmon.integrations.nvml import GpuSampler, NvmlReading  # noqa: E402
from trainmon.kafka_client.memory_transport import MemoryBroker  # noqa: E402
from trainmon.producer import Producer, ProducerConfig  # noqa: E402
from trainmon.schemas import decode, unpack  # noqa: E402
from trainmon import topics  # noqa: E402

from .test_integrations_hf import BATCH, TokenData  # noqa: E402
from .test_integrations_lightning import loader, regression  # noqa: E402

STEPS = 12
MODEL = {"id": 0, "name": "NVIDIA H200", "sm_count": 132, "major": 9, "minor": 0,
         "memory": 150109880320, "free": 149 * 2**30, "l2_size": 62914560, "uuid": "GPU-1",
         "ecc": True, "cuda_driver": "13.0", "cuda_runtime": "13.0"}


@pytest.fixture
def a_gpu(monkeypatch):
    """NVML readings every 20 ms, a gpu_model, and torch.cuda's counters on every
    allocator record. A reading waits (10 s at most) for training to have logged a step:
    on a loaded machine the sampler's thread may otherwise not run again between its
    first reading, at step 0, and the end of a 12-step fit (seen once under the suite)."""
    reading = NvmlReading(index=0, clock_mhz=1980, max_clock_mhz=1980, power_mw=600_000,
                          power_limit_mw=700_000, temperature_c=50, slowdown_temperature_c=89,
                          gpu_util_percent=98, memory_util_percent=40, memory_free_bytes=2**30)

    def sampler(producer):
        made = GpuSampler(producer, interval_s=0.02, health_interval_s=0, reader=lambda: read(made))
        return made

    def read(made: GpuSampler) -> list:
        deadline = time.monotonic() + 10
        while made.step == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        return [reading]

    monkeypatch.setattr(gpu_telemetry, "GpuSampler", sampler)
    monkeypatch.setattr(gpu_telemetry, "gpu_model_fields", lambda: dict(MODEL))
    monkeypatch.setattr(gpu_telemetry, "_cuda_in_use", lambda: True)
    real = gpu_telemetry.allocator_fields
    monkeypatch.setattr(gpu_telemetry, "allocator_fields", lambda model, optimizer: {
        **real(model, optimizer), "allocated": 3 * 2**20, "reserved": 4 * 2**20})


def sent(broker: MemoryBroker, kind: str) -> list:
    return [decode(kind, data) for _, value in broker.topics.get(topics.topic_for(kind), [])
            for data in unpack(value)]


def sampler_threads() -> int:
    return sum(t.name == "trainmon-gpu" for t in threading.enumerate())


def test_the_hf_trainer_sends_gpu_model_gpu_and_allocator_records(a_gpu, tmp_path):
    from trainmon.integrations.hf import TrainmonCallback

    broker = MemoryBroker()
    producer = Producer(ProducerConfig(run_id="hf-gpu", spill_dir=tmp_path / "spill"),
                        transport=broker.transport)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, logging_steps=3, save_strategy="no",
        per_device_train_batch_size=BATCH, report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
    threads = sampler_threads()
    transformers.Trainer(model=model, args=args, train_dataset=TokenData(64, 0),
                         callbacks=[TrainmonCallback(producer)]).train()
    assert sampler_threads() == threads  # stopped at the end of training
    assert producer.flush(10)

    (gpu_model,) = sent(broker, "gpu_model")
    assert gpu_model.name == "NVIDIA H200" and gpu_model.memory == MODEL["memory"]
    gpus = sent(broker, "gpu")
    assert gpus and gpus[-1].step > 0 and gpus[-1].power == 600_000  # steps set as training went
    allocators = sent(broker, "allocator")
    assert [a.step for a in allocators] == [3, 6, 9, 12]  # at each log
    segments = {s.name: s for s in allocators[-1].stats}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert segments["weights"].pageable == weights  # the Trainer's model, from its kwargs
    # AdamW's two moments and its step count (a 4-byte tensor per parameter), through
    # accelerate's wrapper of the optimizer.
    assert segments["optimizer"].pageable == 2 * weights + 4 * len(list(model.parameters()))
    assert allocators[-1].allocated == 3 * 2**20


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_lightning_sends_gpu_model_gpu_and_allocator_records(a_gpu, tmp_path):
    lightning = pytest.importorskip("lightning")
    from trainmon.integrations.lightning import TrainmonLogger

    broker = MemoryBroker()
    producer = Producer(ProducerConfig(run_id="pl-gpu", spill_dir=tmp_path / "spill"),
                        transport=broker.transport)
    threads = sampler_threads()
    trainer = lightning.Trainer(max_steps=STEPS, log_every_n_steps=2, accelerator="cpu", devices=1,
                                enable_progress_bar=False, enable_model_summary=False,
                                enable_checkpointing=False, logger=TrainmonLogger(producer),
                                default_root_dir=str(tmp_path), limit_val_batches=0)
    trainer.fit(regression(lightning), loader(96, 0))
    assert sampler_threads() == threads
    assert producer.flush(10)

    assert [m.name for m in sent(broker, "gpu_model")] == ["NVIDIA H200"]
    assert sent(broker, "gpu")[-1].step > 0
    steps = [s.step for s in sent(broker, "step")]
    allocators = sent(broker, "allocator")
    assert [a.step for a in allocators] == steps and steps  # one with each step record
    assert allocators[-1].reserved == 4 * 2**20 and allocators[-1].stats == []
